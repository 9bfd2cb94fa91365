"""`rollout bench routing`: load-aware routing vs each worker's local-only routing, same run.

Two `hf` replicas of unequal capacity (a big one that batches up to `big_batch` sequences, a
small one limited to `small_batch`) serve three agent-loop worker processes (one consumer
group). The same prompts run twice over fresh topics, on the same replicas: once with
`llm.routing=sticky` (the old default: each worker picks the replica with the fewest of *its
own* requests in flight, so each worker splits its work evenly and the small replica queues)
and once with `llm.routing=load` (the replicas' reported running + waiting, which counts every
worker's requests, over the capacity each reports: 16 and `small_batch`). Responses are
`ignore_eos` with a fixed token budget, so every request costs the same.

Figures: `trajectories_per_s_local` and `trajectories_per_s_load` (final turns on the turns
topic, from the first to the last, Kafka record times; summed over `rounds` runs of each mode,
run in ABBA order, each run with prompts of its own), `ratio` = load / local, and
`requests_local`/`requests_load`: completions each replica answered in that mode (the
replicas' `rollout_replica_completions` counter, before and after).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pipeline.harness.bench.common import bench_broker, prompted_run, tiny_model
from pipeline.launch.local import StageProcess
from pipeline.launch.replicas import wait_healthy
from pipeline.topics import delete_topics
from workers.kafka.config import KafkaConfig
from workers.ports import free_port

__all__ = ["run"]

MODES = {"local": "sticky", "load": "load"}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _completions(url: str) -> int:
    for line in _get(url + "/metrics").splitlines():
        if line.startswith("rollout_replica_completions_total") or line.startswith(
            "rollout_replica_completions{"
        ):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _final_turn_times(
    kafka: KafkaConfig, topic: str, want: int, procs: list[StageProcess], timeout_s: float
) -> list[float]:
    """Kafka timestamps (s) of the first `want` final turns on `topic`, waiting for them."""
    from schemas.codec import decode
    from workers.kafka.clients import make_consumer

    consumer = make_consumer(kafka, topic, group_id=None, name="bench-routing")
    times: list[float] = []
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(seen)}/{want} trajectories in {timeout_s}s")
            for proc in procs:
                if not proc.alive:
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            for records in consumer.poll(timeout_ms=500).values():
                for record in records:
                    turn = decode(record.value)
                    if turn.final and turn.trajectory_id not in seen:
                        seen.add(turn.trajectory_id)
                        times.append(record.timestamp / 1000.0)
    finally:
        consumer.close()
    return sorted(times)


def _one(
    kafka: KafkaConfig,
    model: str,
    urls: list[str],
    root: Path,
    mode: str,
    seed: int,
    *,
    prompts: int,
    n: int,
    max_tokens: int,
    workers: int,
    in_flight_per_worker: int,
    timeout_s: float,
) -> dict[str, Any]:
    run_dir = root / f"{mode}-{seed}"
    (run_dir / "logs").mkdir(parents=True)
    before = {url: _completions(url) for url in urls}  # no worker runs yet: nothing asks them
    cfg = prompted_run(
        kafka,
        model,
        run_dir,
        f"route-{mode}",
        prompts=prompts,
        seed=seed,
        n=n,
        train_batch_size=4,
        max_tokens=max_tokens,
        max_staleness=None,
        in_flight=in_flight_per_worker,
        overrides={"agent_loop": {"llm": {"routing": MODES[mode]}}},
    )
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.redacted(), sort_keys=False))
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli.main",
        "--config",
        str(config_path),
        "worker",
        "agent-loop",
        "--model",
        model,
    ] + [a for url in urls for a in ("--replica", url)]
    procs = [
        StageProcess(f"agent-loop-{i}", argv, run_dir / "logs" / f"agent-loop-{i}.log")
        for i in range(workers)
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    try:
        for proc in procs:
            proc.start(env)
        times = _final_turn_times(
            cfg.kafka, cfg.topics.name("turns"), prompts * n, procs, timeout_s
        )
    finally:
        for proc in procs:
            proc.signal(15)
        for proc in procs:
            if proc.proc is not None:
                try:
                    proc.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:  # a worker that hangs on exit is killed
                    proc.proc.kill()
    after = {url: _completions(url) for url in urls}
    delete_topics(cfg.kafka, cfg.topics)
    span = times[-1] - times[0]
    return {
        "trajectories": len(times),
        "span_s": round(span, 3),
        "trajectories_per_s": round((len(times) - 1) / span, 3) if span > 0 else 0.0,
        "requests": {url: after[url] - before[url] for url in urls},
    }


def run(
    kafka: KafkaConfig,
    *,
    prompts: int = 16,
    n: int = 4,
    max_tokens: int = 32,
    workers: int = 3,
    in_flight: int = 8,
    big_batch: int = 16,
    small_batch: int = 1,
    rounds: int = 2,
    model_dir: str | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    # What every run of both modes shares (`_one`'s keywords), and the replicas' sizes.
    per_run = {
        "prompts": prompts,
        "n": n,
        "max_tokens": max_tokens,
        "workers": workers,
        "in_flight_per_worker": in_flight,
    }
    settings = {**per_run, "big_batch": big_batch, "small_batch": small_batch}
    with (
        tiny_model(model_dir) as model,
        bench_broker(kafka) as kafka_cfg,
        tempfile.TemporaryDirectory(prefix="rollout-bench-routing-") as tmp,
    ):
        root = Path(tmp)
        (root / "logs").mkdir()
        names = {"big": big_batch, "small": small_batch}
        ports = {name: free_port() for name in names}
        replicas = [
            StageProcess(
                name,
                [
                    sys.executable,
                    "-m",
                    "pipeline.cli.main",
                    "replica",
                    "serve",
                    "--backend",
                    "hf",
                    "--model",
                    model,
                    "--port",
                    str(ports[name]),
                    "--replica-id",
                    name,
                    "--threads",
                    "1",
                    "--max-batch",
                    str(batch),
                ],
                root / "logs" / f"{name}.log",
            )
            for name, batch in names.items()
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        try:
            for proc in replicas:
                proc.start(env)
            urls = [f"http://127.0.0.1:{ports[name]}" for name in names]
            for url, proc in zip(urls, replicas, strict=True):
                wait_healthy(url, lambda p=proc: p.alive, 120, name=proc.name, log=proc.log_path)
            # ABBA...: neither mode always runs on warmer replicas; every run has prompts of
            # its own, so no run finds another's prompts in the replicas' prefix caches
            order = [
                m
                for r in range(rounds)
                for m in (("local", "load") if r % 2 == 0 else ("load", "local"))
            ]
            runs = [
                (
                    mode,
                    _one(
                        kafka_cfg, model, urls, root, mode, 100 + i, timeout_s=timeout_s, **per_run
                    ),
                )
                for i, mode in enumerate(order)
            ]
        finally:
            for proc in replicas:
                proc.signal(15)
    label = dict(zip(urls, names, strict=True))
    out: dict[str, Any] = {"benchmark": "routing", **settings, "rounds": rounds}
    for mode in MODES:
        mine = [r for m, r in runs if m == mode]
        done = sum(r["trajectories"] - 1 for r in mine)
        out[f"trajectories_per_s_{mode}"] = round(done / sum(r["span_s"] for r in mine), 3)
        out[f"requests_{mode}"] = {label[u]: sum(r["requests"][u] for r in mine) for u in urls}
        out[f"rounds_{mode}"] = [r["trajectories_per_s"] for r in mine]
    local, load = out["trajectories_per_s_local"], out["trajectories_per_s_load"]
    out["ratio"] = round(load / local, 3) if local else None
    return out
