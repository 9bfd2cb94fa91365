"""`make demo` / `rollout demo`: the pipeline's path so far, end to end on a real broker.

Starts the local broker when no bootstrap address is configured, creates the topics under a
prefix of this run's own, generates an arithmetic dataset in gsm8k format, produces it to
the prompts topic and reads it back. Everything it started is stopped at the end, also on
Ctrl-C. The last line printed is the run's output directory.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pipeline.config import RunConfig, load_config

__all__ = ["run_demo"]


def run_demo(cfg: RunConfig, *, prompts: int = 64, out_root: str = "reports") -> Path:
    from pipeline.data import arithmetic_rows, write_rows
    from pipeline.kafka_local import start_broker, stop_broker
    from pipeline.producer import PromptProducer
    from pipeline.topics import create_topics, delete_topics
    from workers.kafka.stream import EventStream

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(out_root) / f"demo-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    started_port = None
    if "ROLLOUT_KAFKA__BOOTSTRAP_SERVERS" not in os.environ:
        state = start_broker(
            cfg.local_kafka.port, cfg.local_kafka.data_dir, heap=cfg.local_kafka.heap
        )
        if not state.reused:
            started_port = state.port
        cfg = cfg.model_copy(
            update={"kafka": cfg.kafka.model_copy(update={"bootstrap_servers": [state.bootstrap]})}
        )
    topics = cfg.topics.model_copy(update={"prefix": f"demo-{stamp}."})
    try:
        created = create_topics(cfg.kafka, topics)
        print(f"topics: {', '.join(created)}")
        dataset = write_rows(arithmetic_rows(prompts, seed=0), out / "prompts.jsonl")
        with PromptProducer(cfg.kafka, topics) as producer:
            report = producer.produce_file(dataset, progress=True)
        print(report.summary())
        seen: dict[str, object] = {}
        deadline = time.monotonic() + 60
        with EventStream(
            cfg.kafka,
            [topics.name("prompts")],
            group_id=None,
            stage="demo",
            dlq_topic=topics.name("dlq"),
        ) as stream:
            while len(seen) < report.sent and time.monotonic() < deadline:
                for item in stream.poll(timeout_ms=500):
                    seen[item.event.uid] = item.event
        print(f"consumed back {len(seen)}/{report.sent} prompts from {topics.name('prompts')}")
        sample = next(iter(seen.values()), None)
        if sample is not None:
            print(f"example: {sample.model_dump_json()[:200]}…")
        (out / "summary.txt").write_text(
            f"produced {report.sent} prompts to {topics.name('prompts')} on {cfg.kafka.bootstrap}\n"
            f"consumed back {len(seen)}\n"
            f"replay: rollout --bootstrap {cfg.kafka.bootstrap} --set topics.prefix={topics.prefix} "
            "consume --topic prompts\n"
        )
        if started_port is None:
            delete_topics(cfg.kafka, topics)
        if len(seen) != report.sent:
            raise SystemExit(f"demo failed: consumed {len(seen)} of {report.sent}")
    finally:
        if started_port is not None:
            stop_broker(started_port)
            print(f"stopped the local broker on port {started_port}")
    print(out.resolve())
    return out


def main() -> int:
    try:
        run_demo(load_config())
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
