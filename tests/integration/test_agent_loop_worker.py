"""The agent-loop worker on the real broker with real hf replicas (and a scripted one)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from schemas import PolicyVersion, PromptEvent, encode
from schemas.deadletter import DeadLetter
from tests.integration.agent_helpers import (
    finals_by_sample,
    produce_prompts,
    read_turns,
    run_worker_until,
    trajectory,
)
from workers.agent_loop.app import AgentLoopWorker
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.kafka.clients import make_consumer, make_producer
from workers.llm.contract import SamplingParams

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def prompt(uid: str, text: str, **kw) -> PromptEvent:
    return PromptEvent(
        uid=uid,
        prompt=[{"role": "user", "content": text}],
        data_source="openai/gsm8k",
        reward_model={"ground_truth": "5"},
        **kw,
    )


def worker_config(model, replicas, **kw) -> AgentLoopWorkerConfig:
    base = {
        "group_id": "agent-loop-test",
        "model": str(model),
        "n": 2,
        "replicas": [r.address for r in replicas],
        "sampling": SamplingParams(max_tokens=12, temperature=1.0),
        "commit_interval_s": 0.5,
    }
    base.update(kw)
    return AgentLoopWorkerConfig(**base)


async def test_every_sample_yields_one_complete_trajectory(
    kafka_config, topics_config, tiny_model, hf_replicas, unique
) -> None:
    prompts = [prompt(f"st-{i}", f"What is {i} + 3?") for i in range(4)]
    prompts += [
        prompt(f"tool-{i}", f"Use the calculator for {i} * 7.", agent_name="tool_agent", n=3)
        for i in range(2)
    ]
    produce_prompts(kafka_config, topics_config.name("prompts"), prompts)
    expected = {(p.uid, i) for p in prompts for i in range(p.n or 2)}

    cfg = worker_config(tiny_model, hf_replicas, group_id=unique("al"))
    worker = AgentLoopWorker(kafka_config, topics_config, cfg)
    await run_worker_until(worker, lambda: worker.counters["trajectories"] >= len(expected))

    turns = read_turns(
        kafka_config,
        topics_config.name("turns"),
        until=lambda ts: len(finals_by_sample(ts)) >= len(expected),
    )
    finals = finals_by_sample(turns)
    assert set(finals) == expected
    assert all(len(attempts) == 1 for attempts in finals.values())

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for (uid, index), (attempt,) in finals.items():
        traj = trajectory(turns, uid, index, attempt)
        assert [t.turn_index for t in traj] == list(range(len(traj)))
        first, last = traj[0], traj[-1]
        assert first.prompt_ids is not None and first.data_source == "openai/gsm8k"
        assert first.group_size == (next(p for p in prompts if p.uid == uid).n or 2)
        assert last.final and all(not t.final for t in traj[:-1])
        response = np.concatenate([t.token_ids for t in traj])
        assert last.response_length == len(response)
        assert last.extra_fields.min_global_steps == 0 == last.extra_fields.max_global_steps
        text = tokenizer.decode(
            np.concatenate([first.prompt_ids, response]).tolist(), skip_special_tokens=False
        )
        user_text = next(p for p in prompts if p.uid == uid).prompt[0].content
        assert f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n" in text
        for turn in traj:
            if turn.role == "assistant":
                assert turn.logprobs is not None and len(turn.logprobs) == len(turn.token_ids)
                assert np.all(turn.logprobs <= 0)


async def test_sample_slots_count_each_prompts_own_n(
    kafka_config, topics_config, tiny_model, hf_replicas, unique
) -> None:
    """Configured n = 1, prompts of n = 3, 4 slots: never more than 4 samples at once."""
    prompts = [prompt(f"n3-{i}", f"What is {i} + 1?", n=3) for i in range(4)]
    produce_prompts(kafka_config, topics_config.name("prompts"), prompts)
    cfg = worker_config(
        tiny_model, hf_replicas, group_id=unique("al"), n=1, max_samples_in_flight=4
    )
    worker = AgentLoopWorker(kafka_config, topics_config, cfg)
    await run_worker_until(worker, lambda: worker.counters["trajectories"] >= 12)
    assert worker.counters["trajectories"] == 12
    # Counted by the configured n = 1, 4 prompts (12 samples) would have started at once.
    # A sample's slot is free when its generation ends, so a prompt of 3 starts once two
    # of the one before it are done: 4 at most, never more.
    assert 3 <= worker.counters["samples_in_flight_peak"] <= 4


async def test_bad_prompts_go_to_the_dlq_and_the_rest_flows(
    kafka_config, topics_config, tiny_model, hf_replicas, unique
) -> None:
    good = prompt("good-1", "What is 1 + 1?")
    unknown = prompt("bad-agent", "hi", agent_name="no_such_agent")
    too_long = prompt("too-long", "word " * 3000)
    produce_prompts(
        kafka_config, topics_config.name("prompts"), [b"{not json", unknown, too_long, good]
    )
    cfg = worker_config(tiny_model, hf_replicas, group_id=unique("al"), n=1)
    worker = AgentLoopWorker(kafka_config, topics_config, cfg)
    await run_worker_until(
        worker,
        lambda: worker.counters["trajectories"] >= 1 and worker.counters["dead_letters"] >= 3,
    )
    assert worker.counters["dead_letters"] == 3
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in worker.metrics.registry.collect()
        for s in fam.samples
    }
    stage = ("stage", "agent-loop")
    prompts_topic, dlq = topics_config.name("prompts"), topics_config.name("dlq")
    assert samples["rollout_messages_consumed_total", (stage, ("topic", prompts_topic))] == 4
    assert samples["rollout_messages_produced_total", (stage, ("topic", dlq))] == 3
    letters_by_reason = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name == "rollout_dead_letters_total"
    }
    assert sum(letters_by_reason.values()) == 3 and letters_by_reason["DecodeError"] == 1
    assert samples["rollout_trajectory_latency_seconds_count", (stage,)] >= 1
    assert samples["rollout_turn_latency_seconds_count", (stage,)] >= 1

    consumer = make_consumer(kafka_config, topics_config.name("dlq"), group_id=None)
    letters = []
    for _ in range(20):
        for records in consumer.poll(timeout_ms=500).values():
            letters.extend(DeadLetter.from_message(r.headers, r.key, r.value) for r in records)
        if len(letters) >= 3:
            break
    consumer.close()
    causes = sorted(letter.error_cause for letter in letters)
    assert causes == ["json", "prompt_too_long", "unknown_agent"]
    assert all(letter.stage == "agent-loop" for letter in letters)
    unknown_letter = next(letter for letter in letters if letter.error_cause == "unknown_agent")
    assert "no_such_agent" in unknown_letter.error_message and unknown_letter.value == encode(
        unknown
    )
    turns = read_turns(
        kafka_config, topics_config.name("turns"), until=lambda ts: any(t.final for t in ts)
    )
    assert {t.uid for t in turns} == {"good-1"}


async def test_admission_gate_waits_for_the_trainer_and_the_replicas(
    kafka_config, topics_config, tiny_model, hf_replicas, unique
) -> None:
    import asyncio

    import aiohttp

    async def set_version(version: int) -> None:
        async with aiohttp.ClientSession() as http:
            for rep in hf_replicas:
                body = {"path": str(tiny_model), "version": version}
                async with http.post(rep.address + "/update_weights", json=body) as resp:
                    assert resp.status == 200, await resp.text()

    async def settle(count: int) -> None:
        for _ in range(120):
            await asyncio.sleep(0.25)
            if worker.counters["trajectories"] >= count:
                break
        await asyncio.sleep(2.0)

    prompts = [prompt(f"gate-{i}", f"What is {i} + 2?") for i in range(6)]
    produce_prompts(kafka_config, topics_config.name("prompts"), prompts)
    cfg = worker_config(
        tiny_model,
        hf_replicas,
        group_id=unique("al"),
        n=1,
        admission={"max_staleness": 0, "train_batch_size": 2},
    )
    worker = AgentLoopWorker(kafka_config, topics_config, cfg)
    task = asyncio.create_task(worker.run())
    try:
        await settle(2)
        assert worker.counters["prompts_started"] == 2  # one batch, then it waits

        producer = make_producer(kafka_config)
        policy = PolicyVersion(version=1, path=str(tiny_model), groups_trained=2)
        producer.send(topics_config.name("policy"), key="policy", value=encode(policy)).get(
            timeout=30
        )
        producer.close()
        await settle(3)
        assert worker.counters["prompts_started"] == 2  # trained, but the replicas still serve 0

        await set_version(1)
        await settle(4)
        assert worker.counters["prompts_started"] == 4
    finally:
        worker.stop()
        await asyncio.wait_for(task, timeout=60)
        await set_version(0)


async def test_the_gate_counts_the_whole_groups_admissions(
    kafka_config, topics_config, tiny_model, hf_replicas, unique
) -> None:
    """A worker that takes over a group (a restart, a second worker) counts the prompts the
    others took: room for one batch, taken by the first, leaves the second none."""
    import asyncio

    async def started(worker: AgentLoopWorker, count: int, hold_s: float = 3.0) -> None:
        for _ in range(240):
            if (
                worker.counters["prompts_started"] >= count
                and worker.counters["trajectories"] >= count
            ):
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(hold_s)  # long enough for an unbounded gate to admit more
        assert worker.counters["prompts_started"] == count

    produce_prompts(
        kafka_config,
        topics_config.name("prompts"),
        [prompt(f"group-gate-{i}", f"What is {i} + 3?") for i in range(6)],
    )
    cfg = worker_config(
        tiny_model,
        hf_replicas,
        group_id=unique("al"),
        n=1,
        admission={"max_staleness": 0, "train_batch_size": 2},
    )
    first = AgentLoopWorker(kafka_config, topics_config, cfg)
    task = asyncio.create_task(first.run())
    try:
        await started(first, 2)
    finally:
        first.stop()
        await asyncio.wait_for(task, timeout=60)
    second = AgentLoopWorker(kafka_config, topics_config, cfg)
    task = asyncio.create_task(second.run())
    try:
        await started(second, 0)  # the trainer has consumed none of the first's two
    finally:
        second.stop()
        await asyncio.wait_for(task, timeout=60)


async def test_replicas_are_discovered_from_the_replicas_topic(
    kafka_config, kafka_bootstrap, topics_config, tiny_model, unique, tmp_path
) -> None:
    from tests.conftest import ReplicaProcess
    from workers.kafka.clients import make_consumer

    replica = ReplicaProcess(
        tiny_model,
        unique("reg"),
        tmp_path,
        "--register",
        global_args=(
            "--bootstrap",
            kafka_bootstrap,
            "--set",
            f"topics.prefix={topics_config.prefix}",
        ),
    )
    try:
        replica.wait_healthy()
        produce_prompts(
            kafka_config, topics_config.name("prompts"), [prompt("disc-1", "What is 2 + 2?")]
        )
        cfg = worker_config(tiny_model, [], group_id=unique("al"), n=1)  # no replicas: discover
        worker = AgentLoopWorker(kafka_config, topics_config, cfg)
        await run_worker_until(worker, lambda: worker.counters["trajectories"] >= 1, timeout_s=90)
        assert worker.counters["trajectories"] == 1
    finally:
        replica.stop()

    consumer = make_consumer(kafka_config, topics_config.name("replicas"), group_id=None)
    records = []
    for _ in range(20):
        for batch in consumer.poll(timeout_ms=500).values():
            records.extend(batch)
        if len(records) >= 2:
            break
    consumer.close()
    assert records[0].key == replica.replica_id.encode() and records[0].value is not None
    assert (
        records[-1].key == replica.replica_id.encode() and records[-1].value is None
    )  # tombstone on stop
