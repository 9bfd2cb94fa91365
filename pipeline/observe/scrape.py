"""The Prometheus scrape config of a pipeline, written from one source.

`JOBS` is that source: each scrape job, in order, and which of the pipeline's processes it
scrapes (by the process names of `pipeline.launch.local.StagePlan`: `replica-0`, `sync-0`,
`agent-loop` or `agent-loop-1`, `reward`, `replay`, `train`). Two renderings use it:

- `compose_config()`: `infra/prometheus/prometheus.yml`, for docker-compose (targets are
  service names; the scaled agent-loop service is found by DNS). The checked-in file is this
  function's output (`python -m pipeline.observe.scrape > infra/prometheus/prometheus.yml`), and a
  unit test fails when the two differ.
- `local_config(...)`: the same jobs pointing at the ports of a `LocalPipeline` on this
  machine (the integration test's Prometheus scrapes it).

Invariant: every process that serves metrics is in exactly one job, and a job's name does
not depend on where the pipeline runs, so a query by `job` means the same in both.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

import yaml

__all__ = ["COMPOSE_SERVICES", "JOBS", "compose_config", "job_of", "local_config"]

#: job name → pattern of the process names it scrapes.
JOBS: dict[str, re.Pattern[str]] = {
    "agent-loop": re.compile(r"agent-loop(-\d+)?"),
    "reward": re.compile(r"reward"),
    "replay": re.compile(r"replay"),
    "trainer": re.compile(r"train"),
    "sync": re.compile(r"sync-\d+"),
    "replicas": re.compile(r"replica-\d+"),
}

#: docker-compose: stage processes serve /metrics here, replicas on their HTTP port.
COMPOSE_METRICS_PORT = 9400
COMPOSE_REPLICA_PORT = 8000
#: docker-compose service → the process of `StagePlan` it runs
#: (tests/unit/pipeline/observe/test_compose.py
#: checks these against docker-compose.yml's commands).
COMPOSE_SERVICES = {
    "agent-loop": "agent-loop",
    "reward": "reward",
    "replay": "replay",
    "trainer": "train",
    "sync-0": "sync-0",
    "sync-1": "sync-1",
    "replica-0": "replica-0",
    "replica-1": "replica-1",
}
#: Services scaled with `--scale NAME=N`: one name, several containers, found by DNS.
COMPOSE_SCALED = frozenset({"agent-loop"})

_COMPOSE_HEADER = """\
# Prometheus for the docker-compose pipeline: every stage process serves /metrics on 9400
# (`--metrics-port 9400`), every replica on its HTTP port. Targets are compose service names;
# agent-loop scales (`--scale agent-loop=N`), so DNS finds each of its containers.
# Written by `python -m pipeline.observe.scrape > infra/prometheus/prometheus.yml`
# (pipeline/observe/scrape.py holds the jobs; tests/unit/pipeline/observe/test_scrape.py fails
# when this file and that source differ).
"""


def job_of(process: str) -> str:
    """The scrape job of a process name of `StagePlan`; ValueError for an unknown one."""
    for job, pattern in JOBS.items():
        if pattern.fullmatch(process):
            return job
    raise ValueError(f"no scrape job for process {process!r}")


def _render(jobs: list[dict[str, object]], scrape_interval_s: float, header: str = "") -> str:
    interval = f"{scrape_interval_s:g}s"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": "15s"},
        "scrape_configs": jobs,
    }
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def compose_config() -> str:
    """`infra/prometheus/prometheus.yml`: the jobs over docker-compose's service names."""
    services: dict[str, list[str]] = {job: [] for job in JOBS}
    for service, process in COMPOSE_SERVICES.items():
        job = job_of(process)
        port = COMPOSE_REPLICA_PORT if job == "replicas" else COMPOSE_METRICS_PORT
        services[job].append(f"{service}:{port}")
    jobs: list[dict[str, object]] = []
    for job, targets in services.items():
        names = [target.rpartition(":")[0] for target in targets]
        if set(names) <= COMPOSE_SCALED:
            dns = {"names": names, "type": "A", "port": COMPOSE_METRICS_PORT}
            jobs.append({"job_name": job, "dns_sd_configs": [dns | {"refresh_interval": "15s"}]})
        else:
            jobs.append({"job_name": job, "static_configs": [{"targets": targets}]})
    return _render(jobs, 5, _COMPOSE_HEADER)


def local_config(
    metrics_ports: Mapping[str, int],
    replica_ports: Mapping[str, int],
    *,
    scrape_interval_s: float = 1.0,
    host: str = "127.0.0.1",
) -> str:
    """The jobs over one machine's processes: `metrics_ports` (process name → its
    `--metrics-port`, as `LocalPipeline.metrics_ports`) and `replica_ports` (replica process
    name → its HTTP port). Each target carries its process name as the `process` label."""
    by_job: dict[str, list[dict[str, object]]] = {job: [] for job in JOBS}
    for process, port in sorted({**metrics_ports, **replica_ports}.items()):
        target = {"targets": [f"{host}:{port}"], "labels": {"process": process}}
        by_job[job_of(process)].append(target)
    jobs = [
        {"job_name": job, "static_configs": targets} for job, targets in by_job.items() if targets
    ]
    return _render(jobs, scrape_interval_s)


if __name__ == "__main__":
    sys.stdout.write(compose_config())
