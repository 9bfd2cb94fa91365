"""The processes `rollout bench agent-loop` starts besides the replicas: the turns reader and,
for `--workers 2`, agent-loop worker processes. Run as `python -m
pipeline.harness.bench.parts.agent_loop_procs read|worker ...`; a plaintext broker only (the bench's
own, or the one `--bootstrap` names).

- `read BOOTSTRAP TOPIC EXPECTED`: reads the turns topic from its beginning, decodes every
  turn through the codec (what any downstream stage does), and exits 0 once EXPECTED distinct
  trajectories sent their final turn, printing (at once, before closing its consumer)
  `{"finals": N, "turns": M, "cpu_s": S}`: its own CPU seconds since its consumer was made,
  so the bench charges the reader apart.
- `worker BOOTSTRAP PREFIX CONFIG_JSON`: one `AgentLoopWorker` (the config an
  `AgentLoopWorkerConfig` as JSON) on the topics under PREFIX; prints `assigned` once its
  consumer owns partitions (the bench starts its clock after every worker did), marks its
  CPU clock on SIGUSR1 (the bench's clock started) and on SIGUSR2 (stopped) prints
  `{"cpu_s": S}`, its CPU seconds in between (its own nanosecond clock: the kernel's
  /proc/<pid>/stat counts 10 ms ticks, and a small round's worker can use less than one);
  stops gracefully on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from pipeline.harness.bench.common import cpu_seconds
from workers.kafka.config import KafkaConfig

__all__ = ["main"]


def read_turns(bootstrap: str, topic: str, expected: int) -> int:
    from schemas.codec import decode
    from workers.kafka.clients import make_consumer

    kafka = KafkaConfig(bootstrap_servers=bootstrap.split(","))
    consumer = make_consumer(kafka, topic, group_id=None)
    started = cpu_seconds()  # imports and start-up are not the reader's per-turn work
    seen: set[str] = set()
    turns = 0
    try:
        while len(seen) < expected:
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    turn = decode(record.value)
                    turns += 1
                    if turn.final:
                        seen.add(turn.trajectory_id)
        # Printed the moment the last final turn is read: the bench stops its clock on this
        # line, so closing the consumer and the interpreter's exit are not charged to Kafka.
        print(
            json.dumps({"finals": len(seen), "turns": turns, "cpu_s": cpu_seconds() - started}),
            flush=True,
        )
    finally:
        consumer.close()
    return 0


async def serve_worker(bootstrap: str, prefix: str, config_json: str) -> int:
    from workers.agent_loop.app import AgentLoopWorker
    from workers.agent_loop.config import AgentLoopWorkerConfig
    from workers.kafka.config import TopicsConfig

    kafka = KafkaConfig(bootstrap_servers=bootstrap.split(","))
    cfg = AgentLoopWorkerConfig.model_validate_json(config_json)
    worker = AgentLoopWorker(kafka, TopicsConfig(prefix=prefix), cfg)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, worker.stop)
    started = [cpu_seconds()]

    def spent() -> None:
        print(json.dumps({"cpu_s": cpu_seconds() - started[0]}), flush=True)

    loop.add_signal_handler(signal.SIGUSR1, lambda: started.__setitem__(0, cpu_seconds()))
    loop.add_signal_handler(signal.SIGUSR2, spent)
    task = asyncio.create_task(worker.run())
    while worker.consumer is None or not worker.consumer.assignment():
        if task.done():
            task.result()
            return 1
        await asyncio.sleep(0.05)
    print("assigned", flush=True)
    await task
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "read":
        return read_turns(argv[1], argv[2], int(argv[3]))
    if len(argv) == 4 and argv[0] == "worker":
        return asyncio.run(serve_worker(argv[1], argv[2], argv[3]))
    print(
        "usage: python -m pipeline.harness.bench.parts.agent_loop_procs"
        " read BOOTSTRAP TOPIC EXPECTED"
        " | worker BOOTSTRAP PREFIX CONFIG_JSON",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
