"""`rollout bench agent-loop`: what Kafka costs the agent loops.

The same number of prompts, on the same replicas, run (a) by calling the agent loops
directly in one process, bounded to the same concurrency as the worker, and (b) through the
pipeline: the prompts waiting on the prompts topic (produced before the clock starts, as
(a)'s wait in memory) → the agent-loop worker → every turn on the turns topic, consumed by a
reader until every trajectory's final turn has arrived. Each phase gets fresh prompts of the
same shape (so neither profits from the other's prefix cache), phases alternate, their order
turning every other round (a, b, b, a, ...: `common.interleaved`). `ratio` = (b) / (a)
throughput, the median of the rounds' ratios (each round's two sides measured back to back,
under the same load), printed with every round's and their spread. Sized so that each side
runs for seconds, not a fraction of one, and for nine rounds: on two shared cores three runs
of nine agreed within 6% (0.684, 0.720, 0.716) where three of five did not on the same day
(0.639, 0.775, 0.660), and under a second of work they did not at all.

The reader of the turns topic runs in a process of its own (`parts.agent_loop_procs`, as a
downstream stage would). CPU (`common.cpu_seconds`), over each side's timed window only: this
process (`loops`: the bare loops, or the worker), the replicas, the broker when it is one this
machine's launcher runs, and the reader (its own count); `cpu_s_per_trajectory` is each
component's median over the rounds per trajectory, `trajectories_per_core_s` its inverse
(what one core of it sustains), `worker_cpu_ratio_to_direct` the worker's CPU per trajectory
over the bare loops'. `compute_busy_runs`: per side and round, the CPU seconds of what runs on
the loops' core (the loops or worker, the replicas) over the round's wall time; near 1 on both
sides, the cores never waited on Kafka and the ratio is one of CPU per trajectory.

The fair CPU split (`parts.cores.CoreSplit`, on by default, `--cpu-split 0` turns it off): on both
sides the loops and the replicas run on one core, the broker and the reader on another, so
the ratio compares the loops, not who got the cores; `cpu_split` names each component's
cores, or is null with `cpu_split_reason` (one CPU, affinity refused, turned off) and the
run is unpinned.

`--workers 2` adds a third side to every round: the same prompts through two agent-loop
worker processes (one consumer group), on the loops' core. How to read `two_workers`:
`projected_trajectories_per_s` is what the cores sustain if they are never idle, from the
one-worker side's CPU per trajectory of each component: the least, over the cores, of one
core-second over the CPU per trajectory of what runs on it (unpinned: the usable CPUs over
the sum). `kafka_to_projected` and `two_workers_to_projected` are the measured rates over
it: near 1, the per-core figures size a cluster; well under 1, the cores sat idle (latency:
fetches, the reader, the tail of a round), which a second worker hides only if the gap
closes. `workers_cpu_ratio_to_one` is the two workers' CPU per trajectory (together) over
the one worker's: near 1, a worker's CPU per trajectory does not depend on how many run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from pipeline.harness.bench.common import (
    bench_broker,
    cpu_seconds,
    interleaved,
    paired_ratio,
    rates,
    tiny_model,
)
from pipeline.harness.bench.parts.agent_loop_figures import cpu_figures, projection
from pipeline.harness.bench.parts.cores import CoreSplit
from pipeline.launch.replicas import LocalReplicas
from schemas.codec import encode, headers_for
from schemas.events import PromptEvent
from workers.agent_loop.app import AgentLoopWorker
from workers.agent_loop.base import AgentContext
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.agent_loop.loops import get_agent_loop
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
    process (`loops`: the bare loops, or the worker), the other processes named in `pids`."""

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
    *,
    split: CoreSplit | None = None,
    workers: int = 0,
) -> float:
    """Seconds for `prompts` through a worker and the broker, read back by a reader process;
    `meter` (when given) counts the components' CPU over that window and `reader_cpu` gets
    the reader's (`rollout bench vllm` reuses this without them). `workers` 0: the worker
    runs in this process; N: N worker processes (their CPU is the meter's `workers`, as each
    reports it)."""
    meter = meter or _Meter({})
    split = split or CoreSplit(enabled=False)
    topics = TopicsConfig(prefix=f"bench-{uuid.uuid4().hex[:8]}.")
    from pipeline.topics import create_topics, delete_topics

    create_topics(kafka, topics, ["prompts", "turns", "dlq", "policy", "replicas"])
    expected = len(prompts) * cfg.n
    bootstrap = ",".join(kafka.bootstrap_servers)
    procs = "pipeline.harness.bench.parts.agent_loop_procs"
    reader = subprocess.Popen(
        [sys.executable, "-m", procs, "read", bootstrap, topics.name("turns"), str(expected)],
        stdout=subprocess.PIPE,
    )
    split.pin("transport", reader.pid)  # before it starts its threads: they inherit the core
    # The prompts wait on the topic before any worker starts, as the direct side's wait in
    # memory: their producer is upstream, and its CPU (in this process) no part of the
    # worker's, which this process's CPU is charged as.
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
    worker_cfg = cfg.model_copy(update={"group_id": f"bench-{uuid.uuid4().hex[:8]}"})
    if workers:
        worker, task = None, None
        spawned = [
            subprocess.Popen(
                [sys.executable, "-m", procs, "worker", bootstrap, topics.prefix,
                 worker_cfg.model_dump_json()],
                stdout=subprocess.PIPE,
            )
            for _ in range(workers)
        ]  # fmt: skip
        for proc in spawned:
            split.pin("compute", proc.pid)
        # Each prints `assigned` once it owns partitions; the last one's join ends the
        # group's rebalance, so the clock starts on a settled group.
        for proc in spawned:
            line = await asyncio.to_thread(proc.stdout.readline) if proc.stdout else b""
            if line.strip() != b"assigned":
                reader.kill()
                raise RuntimeError(f"a bench worker process exited {proc.wait()}")
    else:
        spawned = []
        worker = AgentLoopWorker(kafka, topics, worker_cfg, tokenizer=tokenizer)
        task = asyncio.create_task(worker.run())
        # Steady state is what is measured: the clock starts once the worker owns its
        # partitions (joining a group is a one-time cost of a process, not of each prompt).
        while worker.consumer is None or not worker.consumer.assignment():
            await asyncio.sleep(0.05)
            if task.done():
                task.result()
    started = time.perf_counter()
    meter.start()
    for proc in spawned:
        proc.send_signal(signal.SIGUSR1)  # each marks its CPU clock (agent_loop_procs)
    # The clock stops on the reader's line (printed when the last final turn is read).
    line = asyncio.create_task(asyncio.to_thread(reader.stdout.readline))  # type: ignore[union-attr]
    while not (await asyncio.wait({line}, timeout=0.05))[0]:
        if (task is not None and task.done()) or any(p.poll() is not None for p in spawned):
            reader.kill()
            if task is not None:
                task.result()
            raise RuntimeError("a bench worker process exited before every turn was read")
    elapsed = time.perf_counter() - started
    meter.stop()
    for proc in spawned:
        proc.send_signal(signal.SIGUSR2)  # each prints its CPU seconds since the mark
    if spawned:
        reports = [await asyncio.to_thread(proc.stdout.readline) for proc in spawned]  # type: ignore[union-attr]
        if not all(reports):
            reader.kill()
            raise RuntimeError("a bench worker process exited before reporting its CPU")
        meter.spent["workers"] = sum(json.loads(line)["cpu_s"] for line in reports)
    if worker is not None and task is not None:
        worker.stop()
        await task
    for proc in spawned:
        proc.terminate()  # SIGTERM: the worker's graceful stop
    for proc in spawned:
        await asyncio.to_thread(proc.wait)
    out = line.result()
    if await asyncio.to_thread(reader.wait) != 0 or not out:
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
    workers: int = 1,
    cpu_split: int = 1,
    model_dir: str | None = None,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    if workers not in (1, 2):
        raise SystemExit(
            f"rollout bench agent-loop: --workers {workers}: 1, or 2 (the projection's check)"
        )
    # The CPUs this process may use before the split pins it (the unpinned projection's).
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    with (
        tiny_model(model_dir) as model,
        bench_broker(kafka) as kafka_cfg,
        LocalReplicas(model, replicas) as reps,
        CoreSplit(enabled=bool(cpu_split)) as split,
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
        for proc in reps.procs:
            split.pin("compute", proc.pid)
        split.pin("transport", broker)
        reader_cpu: dict[str, list[float]] = {"kafka": [], "kafka_2w": []}
        # Per side and round: CPU seconds of each component (this process runs the loops:
        # the worker's on the Kafka side, the bare loops on the direct side).
        cpu: dict[str, dict[str, list[float]]] = {}
        pids = {"replicas": [p.pid for p in reps.procs], "broker": [broker] if broker else []}

        busy: dict[str, list[float]] = {}  # per side and round: the compute core's share used

        def charged(side: str, meter: _Meter, wall: float) -> float:
            for name, seconds in meter.spent.items():
                cpu.setdefault(side, {}).setdefault(name, []).append(seconds)
            compute = sum(meter.spent.get(name, 0.0) for name in ("loops", "workers", "replicas"))
            busy.setdefault(side, []).append(round(compute / wall, 3))
            return samples / wall

        def direct(r: int) -> float:
            meter = _Meter(pids)
            batch = _prompts(prompts, f"direct{r}")
            return charged("direct", meter, asyncio.run(_direct(cfg, tokenizer, batch, meter)))

        def kafka_side(side: str, procs: int) -> Callable[[int], float]:
            def measured(r: int) -> float:
                meter = _Meter(pids)
                batch = _prompts(prompts, f"{side}{r}")
                wall = asyncio.run(
                    _through_kafka(
                        kafka_cfg, cfg, tokenizer, batch, reader_cpu[side], meter,
                        split=split, workers=procs,
                    )
                )  # fmt: skip
                return charged(side, meter, wall)

            return measured

        direct(-1)  # warm-up: the replicas' first requests and the tokenizer, in neither side
        cpu, busy = {}, {}
        sides = {"direct": direct, "kafka": kafka_side("kafka", 0)}
        if workers == 2:
            sides["kafka_2w"] = kafka_side("kafka_2w", 2)
        figures = interleaved(sides, rounds)
        for side, values in reader_cpu.items():
            if values:
                cpu[side]["reader"] = values
        placed = {"loops": "compute", "replicas": "compute", "broker": "transport"}
        report = split.report({**placed, "reader": "transport"})
    result: dict[str, Any] = {
        "benchmark": "agent-loop",
        "trajectories": samples,
        "max_tokens": max_tokens,
        "replicas": replicas,
        "concurrency": concurrency,
        "rounds": rounds,
        "workers": workers,
        **report,
        **rates("direct_trajectories_per_s", figures["direct"], 2),
        **rates("kafka_trajectories_per_s", figures["kafka"], 2),
        **paired_ratio(figures["kafka"], figures["direct"]),
        **cpu_figures(cpu, samples),
        "compute_busy_runs": busy,
    }
    groups = {**placed, "reader": "transport"} if report["cpu_split"] else None
    projected = projection(result["cpu_s_per_trajectory"]["kafka"], groups, usable)
    result["projected_trajectories_per_s"] = round(projected, 2)

    def to_projected(side: str) -> float | None:
        return round(statistics.median(figures[side]) / projected, 3) if projected else None

    result["kafka_to_projected"] = to_projected("kafka")
    if workers == 2:
        two = result["cpu_s_per_trajectory"]["kafka_2w"]
        one = result["cpu_s_per_trajectory"]["kafka"]["loops"]
        result["two_workers"] = {
            **rates("trajectories_per_s", figures["kafka_2w"], 2),
            **paired_ratio(figures["kafka_2w"], figures["kafka"], "ratio_to_one_worker"),
            "two_workers_to_projected": to_projected("kafka_2w"),
            "workers_cpu_ratio_to_one": round(two["workers"] / one, 3) if one else None,
        }
    return result


def _broker_pid(kafka: KafkaConfig) -> int | None:
    """The pid of a broker this machine's launcher runs at the first bootstrap address
    (`rollout kafka up`, or the bench's own); None for any other cluster (not charged)."""
    from pipeline.broker.local import broker_status

    host, _, port = kafka.bootstrap_servers[0].rpartition(":")
    if host not in ("localhost", "127.0.0.1") or not port.isdigit():
        return None
    pid = broker_status(int(port)).get("pid")
    return pid if isinstance(pid, int) else None
