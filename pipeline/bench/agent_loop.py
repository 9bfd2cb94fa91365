"""`rollout bench agent-loop`: what Kafka costs the agent loops.

The same number of prompts, on the same replicas, run (a) by calling the agent loops directly
in one process, bounded to the same concurrency as the worker, and (b) through the pipeline:
produce to the prompts topic → the agent-loop worker → every turn on the turns topic,
consumed by a reader until every trajectory's final turn has arrived. Each phase gets fresh
prompts of the same shape (so neither profits from the other's prefix cache), phases
alternate (a, b, a, b, ...). `ratio` = (b) / (a) throughput, the median of the rounds' ratios
(each round's two sides measured back to back, under the same load), printed with every
round's and their spread. Sized so that each side runs for seconds, not a fraction of one,
and for nine rounds: on two shared cores three runs of nine agreed within 6% (0.684, 0.720,
0.716) where three of five did not on the same day (0.639, 0.775, 0.660), and under a second
of work they did not at all.

The reader of the turns topic runs in a process of its own (`_read_turns`, as a downstream
stage would). CPU (`common.cpu_seconds`), over each side's timed window only: this process
(`loops`: the bare loops, or the worker), the replicas, the broker when it is one this
machine's launcher runs, and the reader (its own count); `cpu_s_per_trajectory` is each
component's median over the rounds per trajectory, `trajectories_per_core_s` its inverse
(what one core of it sustains), `worker_cpu_ratio_to_direct` the worker's CPU per trajectory
over the bare loops'. Not done yet: pinning the components to cores (issue 33, item 1) and
checking the per-core projection against two workers.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

from pipeline.bench.common import (
    bench_broker,
    cpu_seconds,
    interleaved,
    paired_ratio,
    per_core_rate,
    rates,
    tiny_model,
)
from pipeline.launch.replicas import LocalReplicas
from schemas.codec import encode, headers_for
from schemas.events import PromptEvent
from workers.agent_loop.base import AgentContext
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.agent_loop.loops import get_agent_loop
from workers.agent_loop.worker import AgentLoopWorker
from workers.kafka.clients import make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.llm.contract import SamplingParams

__all__ = ["run"]


def _prompts(count: int, tag: str) -> list[PromptEvent]:
    return [
        PromptEvent(
            uid=f"{tag}-{i}",
            prompt=[
                {
                    "role": "user",
                    "content": f"{tag}: what is {i % 10} + {(i * 7) % 10}? Answer with ####.",
                }
            ],
            data_source="openai/gsm8k",
        )
        for i in range(count)
    ]


class _Meter:
    """CPU seconds of each component over one side's timed window (`start` → `stop`): this
    process (`loops`: the bare loops, or the worker), the replicas, the broker if known."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = {name: ps for name, ps in pids.items() if ps}
        self.spent: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {name: sum(cpu_seconds(pid) for pid in ps) for name, ps in self.pids.items()}
        return {"loops": cpu_seconds(), **now}

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> None:
        self.spent = {name: v - self._at[name] for name, v in self._now().items()}


async def _direct(
    cfg: AgentLoopWorkerConfig, tokenizer: Any, prompts: list[PromptEvent], meter: _Meter
) -> float:
    from workers.llm.client import LLMClient

    loop_cls = get_agent_loop(cfg.loops.default_agent)
    limit = asyncio.Semaphore(cfg.max_samples_in_flight)

    async def on_turn(_record: Any) -> None:
        return None

    async with LLMClient(cfg.llm, cfg.replicas) as llm:
        context = AgentContext(
            llm=llm,
            tokenizer=tokenizer,
            on_turn=on_turn,
            max_prompt_length=cfg.loops.max_prompt_length,
            max_response_length=cfg.loops.max_response_length,
        )

        async def sample(prompt: PromptEvent, index: int) -> None:
            async with limit:
                await loop_cls(context).run(
                    cfg.sampling,
                    messages=[m.model_dump(exclude_none=True) for m in prompt.prompt],
                    request_id=f"{prompt.uid}/{index}",
                )

        started = time.perf_counter()
        meter.start()
        await asyncio.gather(*(sample(p, i) for p in prompts for i in range(cfg.n)))
        meter.stop()
        return time.perf_counter() - started


async def _through_kafka(
    kafka: KafkaConfig,
    cfg: AgentLoopWorkerConfig,
    tokenizer: Any,
    prompts: list[PromptEvent],
    reader_cpu: list[float] | None = None,
    meter: _Meter | None = None,
) -> float:
    """Seconds for `prompts` through a worker and the broker, read back by a reader process;
    `meter` (when given) counts the components' CPU over that window and `reader_cpu` gets
    the reader's (`rollout bench vllm` reuses this without them)."""
    meter = meter or _Meter({})
    topics = TopicsConfig(prefix=f"bench-{uuid.uuid4().hex[:8]}.")
    from pipeline.topics import create_topics, delete_topics

    create_topics(kafka, topics, ["prompts", "turns", "dlq", "policy", "replicas"])
    expected = len(prompts) * cfg.n
    # The reader is a process of its own, as a downstream stage would be (`_read_turns`).
    reader = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.bench.agent_loop",
            ",".join(kafka.bootstrap_servers),
            topics.name("turns"),
            str(expected),
        ],
        stdout=subprocess.PIPE,
    )
    worker_cfg = cfg.model_copy(update={"group_id": f"bench-{uuid.uuid4().hex[:8]}"})
    worker = AgentLoopWorker(kafka, topics, worker_cfg, tokenizer=tokenizer)
    task = asyncio.create_task(worker.run())
    # Steady state is what is measured: the clock starts once the worker owns its partitions
    # (joining a consumer group is a one-time cost of a process, not of each prompt).
    while worker.consumer is None or not worker.consumer.assignment():
        await asyncio.sleep(0.05)
        if task.done():
            task.result()
    started = time.perf_counter()
    meter.start()
    producer = make_producer(kafka)
    for prompt in prompts:
        producer.send(
            topics.name("prompts"),
            key=prompt.uid,
            value=encode(prompt),
            headers=headers_for(prompt),
        )
    producer.flush()
    producer.close()
    while reader.poll() is None:
        await asyncio.sleep(0.05)
        if task.done():
            reader.kill()
            task.result()
    elapsed = time.perf_counter() - started
    meter.stop()
    worker.stop()
    await task
    out = reader.stdout.read() if reader.stdout is not None else b""
    if reader.returncode != 0:
        raise RuntimeError(f"the turns reader exited {reader.returncode}")
    if reader_cpu is not None:
        reader_cpu.append(json.loads(out)["cpu_s"])
    delete_topics(kafka, topics)
    return elapsed


def run(
    kafka: KafkaConfig,
    *,
    prompts: int = 96,
    n: int = 4,
    max_tokens: int = 32,
    replicas: int = 2,
    concurrency: int = 32,
    rounds: int = 9,
    model_dir: str | None = None,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    with (
        tiny_model(model_dir) as model,
        bench_broker(kafka) as kafka_cfg,
        LocalReplicas(model, replicas) as reps,
    ):
        tokenizer = AutoTokenizer.from_pretrained(model)
        cfg = AgentLoopWorkerConfig(
            model=model,
            n=n,
            replicas=reps.addresses,
            max_samples_in_flight=concurrency,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
        )
        samples = prompts * n
        broker = _broker_pid(kafka_cfg)
        reader_cpu: list[float] = []
        # Per side and round: CPU seconds of each component (this process runs the loops:
        # the worker's on the Kafka side, the bare loops on the direct side).
        cpu: dict[str, dict[str, list[float]]] = {"direct": {}, "kafka": {}}

        pids = {"replicas": [p.pid for p in reps.procs], "broker": [broker] if broker else []}

        def charged(side: str, meter: _Meter, wall: float) -> float:
            for name, seconds in meter.spent.items():
                cpu[side].setdefault(name, []).append(seconds)
            return samples / wall

        def direct(r: int) -> float:
            meter = _Meter(pids)
            batch = _prompts(prompts, f"direct{r}")
            return charged("direct", meter, asyncio.run(_direct(cfg, tokenizer, batch, meter)))

        def through_kafka(r: int) -> float:
            meter = _Meter(pids)
            batch = _prompts(prompts, f"kafka{r}")
            wall = asyncio.run(_through_kafka(kafka_cfg, cfg, tokenizer, batch, reader_cpu, meter))
            return charged("kafka", meter, wall)

        direct(-1)  # warm-up: the replicas' first requests and the tokenizer, in neither side
        cpu = {"direct": {}, "kafka": {}}
        figures = interleaved({"direct": direct, "kafka": through_kafka}, rounds)
        cpu["kafka"]["reader"] = reader_cpu
    return {
        "benchmark": "agent-loop",
        "trajectories": samples,
        "max_tokens": max_tokens,
        "replicas": replicas,
        "concurrency": concurrency,
        "rounds": rounds,
        **rates("direct_trajectories_per_s", figures["direct"], 2),
        **rates("kafka_trajectories_per_s", figures["kafka"], 2),
        **paired_ratio(figures["kafka"], figures["direct"]),
        **_cpu_figures(cpu, samples),
    }


def _broker_pid(kafka: KafkaConfig) -> int | None:
    """The pid of a broker this machine's launcher runs at the first bootstrap address
    (`rollout kafka up`, or the bench's own); None for any other cluster (not charged)."""
    from pipeline.broker.local import broker_status

    host, _, port = kafka.bootstrap_servers[0].rpartition(":")
    if host not in ("localhost", "127.0.0.1") or not port.isdigit():
        return None
    pid = broker_status(int(port)).get("pid")
    return pid if isinstance(pid, int) else None


def _cpu_figures(cpu: dict[str, dict[str, list[float]]], samples: int) -> dict[str, Any]:
    """CPU seconds per trajectory of each component on each side (median of the rounds),
    what one core of each sustains, and the loops' CPU through Kafka over in process."""
    per_traj = {
        side: {name: statistics.median(values) / samples for name, values in parts.items()}
        for side, parts in cpu.items()
    }
    loops = per_traj["direct"].get("loops", 0.0)
    return {
        "cpu_s_per_trajectory": {
            side: {name: round(v, 6) for name, v in parts.items()}
            for side, parts in per_traj.items()
        },
        "trajectories_per_core_s": {
            side: {name: round(per_core_rate(1, v), 1) for name, v in parts.items()}
            for side, parts in per_traj.items()
        },
        # The worker (loops + Kafka path) over the bare loops, in CPU per trajectory.
        "worker_cpu_ratio_to_direct": round(per_traj["kafka"]["loops"] / loops, 3)
        if loops
        else None,
    }


def _read_turns(argv: list[str]) -> int:
    """The bench's reader of `rl.turns`, run as `python -m pipeline.bench.agent_loop BOOTSTRAP
    TOPIC EXPECTED`: reads the topic from its beginning, decodes every turn through the codec
    (what any downstream stage does), and exits 0 once EXPECTED distinct trajectories sent
    their final turn, printing `{"finals": N, "turns": M, "cpu_s": S}`: its own CPU seconds
    since its consumer was made, so the bench charges the reader apart from the worker.
    A plaintext broker only (the bench's own, or the one `--bootstrap` names)."""
    from schemas.codec import decode
    from workers.kafka.clients import make_consumer

    bootstrap, topic, expected = argv[0], argv[1], int(argv[2])
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
    finally:
        consumer.close()
    print(
        json.dumps({"finals": len(seen), "turns": turns, "cpu_s": cpu_seconds() - started}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(_read_turns(sys.argv[1:]))
