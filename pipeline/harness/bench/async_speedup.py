"""`rollout bench async-speedup`: synchronous vs asynchronous RL, same work, same run.

The whole pipeline runs twice on the same broker — every stage its own process, one `hf`
replica and the trainer each limited to one CPU thread (as each would own its GPUs) — for the
same number of trainer steps: once with `max_staleness: 0` (generation waits for every new
version: synchronous RL) and once with `max_staleness: 2` (generation runs up to two versions
ahead while the trainer trains). The figure is the steady-state time per step: from the
first trainer step to the last (the pipeline's start-up and first fill are the same in both
and excluded). ratio = synchronous wall time / asynchronous wall time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pipeline.harness.bench.common import (
    bench_broker,
    prompted_run,
    tiny_model,
    trainer_steps,
    watch_until,
)
from pipeline.launch.local import LocalPipeline
from pipeline.topics import delete_topics
from workers.kafka.config import KafkaConfig

__all__ = ["run"]


def _one(
    kafka: KafkaConfig,
    model: str,
    staleness: int,
    root: Path,
    *,
    steps: int,
    batch: int,
    n: int,
    max_tokens: int,
) -> dict[str, Any]:
    """One run at `max_staleness = staleness` with the benchmark's settings (`run`)."""
    run_dir = root / f"staleness-{staleness}"
    cfg = prompted_run(
        kafka,
        model,
        run_dir,
        f"async-{staleness}",
        # Enough prompts for every step even if some groups are dropped as stale.
        prompts=batch * (steps + 4) * 2,
        seed=staleness,
        n=n,
        train_batch_size=batch,
        max_tokens=max_tokens,
        max_staleness=staleness,
        in_flight=batch * n * (staleness + 1),
        overrides={"trainer": {"max_steps": steps}},
    )
    with LocalPipeline(cfg, run_dir, model_dir=model, replicas=1, replica_threads=1) as pipe:
        watch_until(
            pipe,
            lambda: not pipe.process("train").alive,
            900,
            f"the trainer did not finish {steps} steps in time",
        )
    records = trainer_steps(cfg)
    times = [r["time"] for r in records]
    staleness_seen = max((int(k) for r in records for k in r["staleness_hist"]), default=0)
    delete_topics(cfg.kafka, cfg.topics)
    return {
        "steps": len(records),
        "wall_s": round(times[-1] - times[0], 3),
        "s_per_step": round((times[-1] - times[0]) / max(1, len(times) - 1), 3),
        "max_staleness_seen": staleness_seen,
        "train_s_per_step": round(sum(r["step_time_s"] for r in records) / len(records), 3),
    }


def run(
    kafka: KafkaConfig,
    *,
    steps: int = 8,
    batch: int = 2,
    n: int = 4,
    max_tokens: int = 48,
    model_dir: str | None = None,
) -> dict[str, Any]:
    settings = {"steps": steps, "batch": batch, "n": n, "max_tokens": max_tokens}
    with (
        tiny_model(model_dir) as model,
        bench_broker(kafka) as kafka_cfg,
        tempfile.TemporaryDirectory() as tmp,
    ):
        sync = _one(kafka_cfg, model, 0, Path(tmp), **settings)
        asynchronous = _one(kafka_cfg, model, 2, Path(tmp), **settings)
    return {
        "benchmark": "async-speedup",
        **settings,
        "sync": sync,
        "async": asynchronous,
        "sync_wall_s": sync["wall_s"],
        "async_wall_s": asynchronous["wall_s"],
        "max_staleness_seen": {
            "0": sync["max_staleness_seen"],
            "2": asynchronous["max_staleness_seen"],
        },
        "ratio": round(sync["wall_s"] / asynchronous["wall_s"], 3)
        if asynchronous["wall_s"]
        else None,
    }
