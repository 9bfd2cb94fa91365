"""`rollout bench pipeline`: trajectories per second through every stage, 1 and 2 workers.

The whole pipeline runs twice on the same broker (every stage its own process, two `hf`
replicas): with one agent-loop worker process and with two, each over its own topics and
the same prompts. The figure is the steady-state rate at which samples are trained: from
the trainer's step log, samples of every step after the first over the time from the first
step to the last (start-up and the first fill are excluded the same way in both). Admission
is unbounded so generation is never held back by the trainer.

The baseline, in the same run on the same broker: the raw kafka-python produce→consume rate
of messages of the mean size of the run's `ScoredTrajectory` records (acks=all, idempotent),
from the first send to the last record received. The ratios put the pipeline (which
generates with a model) against the transport alone; `scaling_2w_over_1w` shows whether a
second worker process helps (it does not when the replicas are the bottleneck, as on CPU).
"""

from __future__ import annotations

import tempfile
import time
import uuid
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


def _mean_value_size(kafka: KafkaConfig, topic: str) -> int:
    from kafka import TopicPartition

    from workers.kafka.clients import make_consumer

    consumer = make_consumer(kafka, group_id=None, name="bench-sizes")
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        sizes: list[int] = []
        for _ in range(20):
            for batch in consumer.poll(timeout_ms=500).values():
                sizes.extend(len(r.value) for r in batch)
            if len(sizes) >= 200:
                break
        return int(sum(sizes) / len(sizes)) if sizes else 1024
    finally:
        consumer.close()


def _one(
    kafka: KafkaConfig,
    model: str,
    workers: int,
    root: Path,
    *,
    prompts: int,
    n: int,
    batch: int,
    max_tokens: int,
    replicas: int,
    timeout_s: float,
) -> dict[str, Any]:
    run_dir = root / f"{workers}w"
    cfg = prompted_run(
        kafka,
        model,
        run_dir,
        f"e2e-{workers}w",
        prompts=prompts,
        seed=1,
        n=n,
        train_batch_size=batch,
        max_tokens=max_tokens,
        max_staleness=None,
        sync_every=4,
    )
    total = prompts * n
    with LocalPipeline(
        cfg, run_dir, model_dir=model, replicas=replicas, agent_loop_workers=workers
    ) as pipe:
        watch_until(
            pipe,
            lambda: sum(r["samples"] for r in trainer_steps(cfg)) >= total,
            timeout_s,
            f"{workers} worker(s): not every sample trained in {timeout_s}s",
        )
    steps = trainer_steps(cfg)
    size = _mean_value_size(cfg.kafka, cfg.topics.name("scored"))
    delete_topics(cfg.kafka, cfg.topics)
    span = steps[-1]["time"] - steps[0]["time"]
    after_first = sum(r["samples"] for r in steps[1:])
    return {
        "agent_loop_workers": workers,
        "samples": total,
        "steps": len(steps),
        "steady_s": round(span, 3),
        "trajectories_per_s": round(after_first / span, 2) if span > 0 else 0.0,
        "scored_message_bytes": size,
    }


def _raw_rate(kafka: KafkaConfig, size: int, count: int) -> float:
    """kafka-python: produce `count` messages of `size` bytes and consume them; messages/s."""
    from workers.kafka.admin import TopicLayout, ensure_topics
    from workers.kafka.clients import make_admin, make_consumer, make_producer

    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka, [TopicLayout(topic, 4)])
    admin = make_admin(kafka)
    try:
        consumer = make_consumer(kafka, topic, group_id=None, name="bench-raw")
        consumer.poll(timeout_ms=1000)  # join: assignment before the clock starts
        producer = make_producer(kafka, name="bench-raw", batch_size=1024 * 1024)
        payload = bytes(size)
        started = time.perf_counter()
        for i in range(count):
            producer.send(topic, key=str(i).encode(), value=payload)
        producer.flush(timeout=120)
        received = 0
        deadline = time.monotonic() + 120
        while received < count and time.monotonic() < deadline:
            received += sum(len(b) for b in consumer.poll(timeout_ms=500).values())
        elapsed = time.perf_counter() - started
        producer.close()
        consumer.close()
        return received / elapsed
    finally:
        admin.delete_topics([topic])
        admin.close()


def run(
    kafka: KafkaConfig,
    *,
    prompts: int = 48,
    n: int = 4,
    batch: int = 4,
    max_tokens: int = 16,
    replicas: int = 2,
    raw_messages: int = 5000,
    model_dir: str | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    settings = {
        "prompts": prompts,
        "n": n,
        "batch": batch,
        "max_tokens": max_tokens,
        "replicas": replicas,
    }
    with (
        tiny_model(model_dir) as model,
        bench_broker(kafka) as kafka_cfg,
        tempfile.TemporaryDirectory() as tmp,
    ):
        one = _one(kafka_cfg, model, 1, Path(tmp), timeout_s=timeout_s, **settings)
        two = _one(kafka_cfg, model, 2, Path(tmp), timeout_s=timeout_s, **settings)
        size = max(one["scored_message_bytes"], two["scored_message_bytes"])
        raw = _raw_rate(kafka_cfg, size, raw_messages)
    t1, t2 = one["trajectories_per_s"], two["trajectories_per_s"]
    return {
        "benchmark": "pipeline",
        **settings,
        "trajectories_per_s_1w": t1,
        "trajectories_per_s_2w": t2,
        "raw_messages_per_s": round(raw, 1),
        "raw_message_bytes": size,
        "ratio_1w": round(t1 / raw, 5) if raw else None,
        "ratio_2w": round(t2 / raw, 5) if raw else None,
        "scaling_2w_over_1w": round(t2 / t1, 3) if t1 else None,
        "runs": {"1w": one, "2w": two},
    }
