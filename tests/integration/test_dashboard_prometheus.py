"""Every panel of the Grafana dashboard shows data from a live run, read by a real Prometheus.

A short pipeline runs on the real broker (`LocalPipeline`: two hf replicas with the tiny
model, a sync controller beside each, the agent-loop worker, reward, replay and the trainer,
every stage with `--metrics-port`). Prometheus scrapes it every second with the jobs of
`infra/prometheus/prometheus.yml` (both written by `pipeline.observe.scrape`) pointed at the run's
ports. Then:

1. every target is `up`;
2. every query of every panel, variables filled in as Grafana fills them, returns at least
   one series with a finite value through `/api/v1/query` (polled until it does: rates and
   quantiles need samples inside their window) — except the panels in `EMPTY_WHEN_CLEAN`,
   which must be empty in a clean run, and which a poison record then fills, and those in
   `NOT_IN_THIS_RUN` (a feature the run does not use), which must stay empty;
3. once the run is quiet (every prompt answered and trained on, nothing counted for a few
   scrapes), `rollout status` and Prometheus read just before it and one scrape interval
   after it agree exactly: records produced per topic = its end offset, consumed per stage
   and topic = the stage's committed offset, every stage's and replica's policy version =
   the newest on the policy topic.

Skipped, with the reason, where the `prometheus` binary is not installed (`.ci/run`
installs Debian's package when it runs as root).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.data.arithmetic import arithmetic_rows
from pipeline.data.producer import PromptProducer
from pipeline.harness.local_run import local_run_config
from pipeline.launch.local import LocalPipeline
from pipeline.observe.scrape import job_of, local_config
from tests.conftest import run_cli
from tests.integration.prometheus_helpers import (
    PanelQuery,
    Prometheus,
    dashboard_queries,
    prometheus_binary,
)
from workers.kafka.clients import make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.skipif(
        prometheus_binary() is None,
        reason="no `prometheus` binary (apt-get install prometheus; .ci/run does it as root)",
    ),
]

SCRAPE_S = 1.0
#: `$__interval` for the dashboard's default range (30 min) on a ~1000 px wide panel: Grafana
#: rounds 1.8 s to 2 s, so `$__rate_interval` is 4 scrapes.
INTERVAL_S = 2.0
PROMPTS, N, BATCH = 40, 2, 2
#: Panels that a clean run leaves empty, and why; the poison record fills each.
EMPTY_WHEN_CLEAN = {
    "Dead letters (since each process started)": "a clean run dead-letters nothing",
}
#: Panels of a feature this run does not use: empty here, and read where the feature runs.
NOT_IN_THIS_RUN = {
    "LLM judge verdicts (since each process started)": (
        "no reward.judge here; tests/integration/test_judge.py reads the counter from /metrics"
    ),
}
#: Panels that must show more than 0 at some point while records flow (0 throughout would
#: be a query that reads nothing, e.g. rate() over a series that never moves). Not here, and
#: 0 in this run for a true reason: loss and reward (the untrained tiny model answers nothing
#: right, so every advantage is 0), staleness (0 while the trainer keeps up with the agents),
#: the prefix-cache hit rate (a prompt's samples are prefilled together, and a new version
#: clears the cache before another request could reuse a finished prompt).
POSITIVE = {
    "Consumed per second",
    "Produced per second",
    "Turn latency",
    "Trajectory latency",
    "Policy version",
    "Generated tokens per second",
    "Trainer steps per minute",
    "Dead letters (since each process started)",
}

Seen = dict[tuple[str, str], tuple[dict[str, str], float]]


def test_every_panel_shows_data_from_a_live_run(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tiny_model: Path, tmp_path: Path
) -> None:
    cfg = local_run_config(
        kafka_config,
        topics_config.prefix,
        tiny_model,
        tmp_path,
        n=N,
        train_batch_size=BATCH,
        max_tokens=8,
        max_staleness=1,
        in_flight=8,
    )
    queries = dashboard_queries(SCRAPE_S, INTERVAL_S)
    assert set(EMPTY_WHEN_CLEAN) | set(NOT_IN_THIS_RUN) | POSITIVE <= {q.panel for q in queries}
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(PROMPTS, seed=3), uid_prefix="prom")
    with LocalPipeline(cfg, tmp_path / "run", model_dir=str(tiny_model), metrics=True) as pipe:
        replicas = {
            f"replica-{i}": int(url.rpartition(":")[2]) for i, url in enumerate(pipe.replica_urls)
        }
        config = local_config(pipe.metrics_ports, replicas, scrape_interval_s=SCRAPE_S)
        prom = Prometheus(prometheus_binary() or "", config, tmp_path / "prometheus")
        try:
            prom.wait_ready()
            _wait_all_up(prom, pipe, set(pipe.metrics_ports) | set(replicas))
            unused = {**EMPTY_WHEN_CLEAN, **NOT_IN_THIS_RUN}
            clean = [q for q in queries if q.panel not in unused]
            seen = _wait_panels(prom, pipe, clean)
            for q in queries:
                if q.panel in unused:  # the clean run is clean; unused features count nothing
                    assert prom.query(q.expr) == [], (q.panel, unused[q.panel])
            _status_agrees(prom, pipe, kafka_config, cfg.topics)
            _poison(kafka_config, cfg.topics)
            seen |= _wait_panels(prom, pipe, [q for q in queries if q.panel in EMPTY_WHEN_CLEAN])
        finally:
            prom.stop()
    print("\npanel [legend]: value {labels}")
    for q in queries:
        if q.panel in NOT_IN_THIS_RUN:
            continue
        labels, value = seen[(q.panel, q.legend)]
        print(f"  {q.panel} [{q.legend}]: {value:.4g} {labels}")


def _wait_all_up(prom: Prometheus, pipe: LocalPipeline, processes: set[str]) -> None:
    health: dict[str, str] = {}
    deadline = time.monotonic() + 180  # the stages' own start: seconds idle, a minute loaded
    while time.monotonic() < deadline:
        pipe.check()
        targets = prom.targets()
        health = {t["labels"]["process"]: t["health"] for t in targets}
        if set(health) == processes and all(h == "up" for h in health.values()):
            for t in targets:  # the job names are the ones of infra/prometheus/prometheus.yml
                assert t["labels"]["job"] == job_of(t["labels"]["process"])
            return
        time.sleep(0.5)
    pytest.fail(f"targets not all up: {health}\n{prom.tail()}")


def _wait_panels(prom: Prometheus, pipe: LocalPipeline, queries: list[PanelQuery]) -> Seen:
    """Poll until each query has returned a finite value (a positive one for `POSITIVE`)."""
    seen: Seen = {}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(seen) < len(queries):
        pipe.check()
        for q in queries:
            if (q.panel, q.legend) not in seen:
                rows = sorted(prom.finite(q.expr), key=lambda row: -row[1])
                if rows and (q.panel not in POSITIVE or rows[0][1] > 0):
                    seen[(q.panel, q.legend)] = rows[0]
        time.sleep(0.5)
    missing = [(q.panel, q.legend, q.expr) for q in queries if (q.panel, q.legend) not in seen]
    assert not missing, f"no data from: {json.dumps(missing, indent=1)}"
    return seen


def _quiet(prom: Prometheus) -> bool:
    """Every prompt read, every process on the trainer's version, no counter moved for 3
    scrapes."""
    window = f"{3 * SCRAPE_S:g}s"
    moved = prom.query(
        f"sum(changes(rollout_messages_produced_total[{window}]))"
        f" + sum(changes(rollout_messages_consumed_total[{window}]))"
    )
    prompts = prom.query('sum(rollout_messages_consumed_total{stage="agent-loop"})')
    # Every stage and replica on the trainer's version (the reward stage keeps none).
    newest = 'max(rollout_policy_version{stage="train"})'
    behind = [
        prom.query(f"{newest} - min(rollout_policy_version)"),
        prom.query(f"{newest} - min(rollout_replica_policy_version)"),
    ]
    return (
        [v for _, v in moved] == [0]
        and [v for _, v in prompts] == [PROMPTS]
        and all([v for _, v in rows] == [0] for rows in behind)
    )


def _status_agrees(
    prom: Prometheus, pipe: LocalPipeline, kafka: KafkaConfig, topics: TopicsConfig
) -> None:
    deadline = time.monotonic() + 120
    while not _quiet(prom):
        pipe.check()
        assert time.monotonic() < deadline, "the run never went quiet"
        time.sleep(0.5)
    before = time.time()
    status = run_cli(
        "--bootstrap",
        kafka.bootstrap,
        "--set",
        f"topics.prefix={topics.prefix}",
        "status",
        "--json",
        "--interval",
        "0.5",
    )
    assert status.returncode == 0, status.stderr
    seen = json.loads(status.stdout)
    after = time.time() + SCRAPE_S
    while time.time() < after:  # a scrape that began after status had read everything
        time.sleep(0.1)
    ends = {t: row["end_offset"] for t, row in seen["topics"].items() if row["end_offset"]}
    produced_by_pipeline = {t: n for t, n in ends.items() if t != topics.name("prompts")}
    committed = {t: row["committed"] for g in seen["groups"].values() for t, row in g.items()}
    for at in (before, after):
        produced = {
            r["topic"]: v
            for r, v in prom.query("sum by (topic) (rollout_messages_produced_total)", at=at)
        }
        replicas_topic = topics.name("replicas")  # registrations: written by no stage process
        assert produced == {t: n for t, n in produced_by_pipeline.items() if t != replicas_topic}
        consumed = {
            r["topic"]: v
            for r, v in prom.query(
                'sum by (topic) (rollout_messages_consumed_total{stage!="sync"})', at=at
            )
        }
        assert consumed == committed
        # Each sync controller reads the whole policy topic (no group: nothing committed).
        synced = prom.query('rollout_messages_consumed_total{stage="sync"}', at=at)
        assert [v for _, v in synced] == [ends[topics.name("policy")]] * len(pipe.replica_urls)
        # The reward stage keeps no policy version; every other process knows the newest.
        rows = prom.query("rollout_policy_version", at=at)
        rows += prom.query("rollout_replica_policy_version", at=at)
        versions = {r["process"]: v for r, v in rows}
        assert versions == dict.fromkeys(
            set(pipe.metrics_ports) - {"reward"} | {"replica-0", "replica-1"},
            seen["policy_version"],
        )
    assert sorted(r["version"] for r in seen["replicas"]) == [seen["policy_version"]] * 2


def _poison(kafka: KafkaConfig, topics: TopicsConfig) -> None:
    """One undecodable record on rl.turns: the reward stage dead-letters it (DecodeError)."""
    producer = make_producer(kafka)
    try:
        producer.send(topics.name("turns"), key="poison", value=b"\x00 not an event")
        producer.flush(timeout=30)
    finally:
        producer.close()
