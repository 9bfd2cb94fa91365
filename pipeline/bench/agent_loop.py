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
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

from pipeline.bench.common import bench_broker, interleaved, paired_ratio, rates, tiny_model
from pipeline.launch.replicas import LocalReplicas
from schemas.codec import decode, encode, headers_for
from schemas.events import PromptEvent
from workers.agent_loop.base import AgentContext
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.agent_loop.loops import get_agent_loop
from workers.agent_loop.worker import AgentLoopWorker
from workers.kafka.clients import make_consumer, make_producer
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


async def _direct(cfg: AgentLoopWorkerConfig, tokenizer: Any, prompts: list[PromptEvent]) -> float:
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
        await asyncio.gather(*(sample(p, i) for p in prompts for i in range(cfg.n)))
        return time.perf_counter() - started


async def _through_kafka(
    kafka: KafkaConfig, cfg: AgentLoopWorkerConfig, tokenizer: Any, prompts: list[PromptEvent]
) -> float:
    topics = TopicsConfig(prefix=f"bench-{uuid.uuid4().hex[:8]}.")
    from pipeline.topics import create_topics, delete_topics

    create_topics(kafka, topics, ["prompts", "turns", "dlq", "policy", "replicas"])
    expected = len(prompts) * cfg.n
    finished = threading.Event()

    def read_finals() -> None:
        consumer = make_consumer(kafka, topics.name("turns"), group_id=None)
        seen: set[str] = set()
        try:
            while len(seen) < expected:
                for records in consumer.poll(timeout_ms=200).values():
                    for record in records:
                        turn = decode(record.value)
                        if turn.final:
                            seen.add(turn.trajectory_id)
        finally:
            consumer.close()
            finished.set()

    reader = threading.Thread(target=read_finals, daemon=True)
    reader.start()
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
    while not finished.is_set():
        await asyncio.sleep(0.05)
        if task.done():
            task.result()
    elapsed = time.perf_counter() - started
    worker.stop()
    await task
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

        def direct(r: int) -> float:
            return samples / asyncio.run(_direct(cfg, tokenizer, _prompts(prompts, f"direct{r}")))

        def through_kafka(r: int) -> float:
            wall = asyncio.run(
                _through_kafka(kafka_cfg, cfg, tokenizer, _prompts(prompts, f"kafka{r}"))
            )
            return samples / wall

        direct(-1)  # warm-up: the replicas' first requests and the tokenizer, in neither side
        figures = interleaved({"direct": direct, "kafka": through_kafka}, rounds)
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
    }
