"""`rollout bench reward --json`: the reward stage's throughput against the bare-copy limit.

On one broker, in one run, over the same messages (N trajectories × `turns` turn events of
`tokens` tokens each, gsm8k scorer):

- stage: `rollout worker reward` consumes the turns and emits N `ScoredTrajectory`s;
- copy: a bare consume→produce copy of the same turn messages with kafka-python and with
  aiokafka (idempotent, acks=all, 1 MiB batches, like the stage's producer), the faster one
  counting — the limit for any stage that reads and writes every message. Both read
  `batch_size` records per poll.

A copy of 8,000 messages lasts well under a second, so one run swings with the machine's
noise (8k to 25k msgs/s seen within minutes). So the aiokafka copy and the stage each run
`runs` times, interleaved (copy, stage, copy, stage, …; each stage run on its own copy of
the turns), and the best run of each counts: the same statistic on both sides of the
ratio. `ratio_of_medians` is reported beside it. While the stage runs, the harness only
asks for `rl.scored`'s end offsets; it reads the outputs' timestamps afterwards (a reader
running alongside would take CPU from the stage alone).

Also reported:

- decoding copy (beside the ratio, not instead of it): the aiokafka copy once more, but
  each message is decoded through the codec (validated into a `TurnEvent`) before its bytes
  are produced: the least work of any stage that validates every message it reads.
  `ratio_to_decoding_copy` compares the stage with it.

Every rate is measured the same way: from the CreateTime timestamps of the first and last
output record ((count − 1) / span), so start-up, group joins and table recovery are
excluded. `ratio` = stage trajectories/s ÷ (copy messages/s ÷ turns). Also measured:
math-verify items/s through the scorer pool. Prints nothing itself; returns one dict.

CPU (`cpu_s_per_trajectory`, `common.cpu_seconds`): the stage process's user + system
seconds from its first output to its last, per trajectory in between; each copy's, in this
process, from its first acknowledged batch to its last, per trajectory copied in between.
Wall rates on a shared machine swing with others' load, CPU seconds much less:
`cpu_ratio_to_decoding_copy` (the decoding copy's CPU per trajectory ÷ the stage's) is the
same comparison as `ratio_to_decoding_copy` counted in CPU, and `trajectories_per_core_s`
what one core of each sustains.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.harness.bench.common import cpu_seconds, per_core_rate
from schemas.codec import encode, headers_for
from schemas.events import ExtraFields, RewardModelSpec, TurnEvent
from workers.kafka.config import KafkaConfig, TopicsConfig

__all__ = ["run"]

log = logging.getLogger("rollout.bench.reward")

_REPO = Path(__file__).resolve().parents[2]
_MATH_ITEMS = [
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("Answer: $x^2+2x+1$", "(x+1)^2"),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
    ("\\boxed{3.14}", "\\pi"),
]


def _turns(tok: Any, n: int, turns: int, tokens: int) -> list[TurnEvent]:
    rng = random.Random(0)
    vocab = min(len(tok), 1000)
    out = []
    for i in range(n):
        uid = f"b{i}"
        for j in range(turns):
            final = j == turns - 1
            ids = [rng.randrange(3, vocab) for _ in range(tokens)]
            if final:
                answer = tok.encode(f" #### {i}")
                ids = ids[: tokens - len(answer)] + answer
            role = "assistant" if j % 2 == 0 or final else "tool"
            out.append(
                TurnEvent(
                    trajectory_id=f"{uid}/0",
                    uid=uid,
                    sample_index=0,
                    attempt_id="a",
                    turn_index=j,
                    role=role,
                    token_ids=ids,
                    logprobs=[-0.5] * tokens if role == "assistant" else None,
                    min_global_steps=1,
                    max_global_steps=1,
                    final=final,
                    prompt_ids=ids[:64] if j == 0 else None,
                    data_source="openai/gsm8k" if j == 0 else None,
                    reward_model=RewardModelSpec(ground_truth=str(i)) if j == 0 else None,
                    num_turns=turns + 1 if final else None,
                    extra_fields=(
                        ExtraFields(min_global_steps=1, max_global_steps=1) if final else None
                    ),
                )
            )
    return out


def _rate(timestamps_ms: list[int]) -> float:
    if len(timestamps_ms) < 2:
        return 0.0
    span = (max(timestamps_ms) - min(timestamps_ms)) / 1000.0
    return (len(timestamps_ms) - 1) / max(span, 1e-3)


def _await_count(kafka: KafkaConfig, topic: str, count: int, timeout: float) -> int:
    """Wait until `topic` holds `count` records, asking only for its end offsets (a reader
    of the records would take CPU from the process being measured, on a small machine);
    how many it held then."""
    from kafka import TopicPartition

    from workers.kafka.clients import make_consumer

    consumer = make_consumer(kafka, group_id=None)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            held = sum(consumer.end_offsets(parts).values()) if parts else 0
            if held >= count:
                return held
            time.sleep(0.2)
    finally:
        consumer.close()
    return 0


def _timestamps(kafka: KafkaConfig, topic: str, count: int, timeout: float) -> list[int]:
    from workers.kafka.clients import make_consumer

    consumer = make_consumer(kafka, topic, group_id=None)
    stamps: list[int] = []
    deadline = time.monotonic() + timeout
    try:
        while len(stamps) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500, max_records=5000).values():
                stamps.extend(r.timestamp for r in batch)
    finally:
        consumer.close()
    return stamps


def _copy_kafka_python(kafka: KafkaConfig, src: str, dst: str, count: int, per_poll: int) -> None:
    from workers.kafka.clients import make_consumer, make_producer

    consumer = make_consumer(kafka, src, group_id=None, max_poll_records=per_poll)
    producer = make_producer(kafka, name="bench-copy", batch_size=1024 * 1024)
    copied = 0
    try:
        while copied < count:
            for batch in consumer.poll(timeout_ms=500).values():
                for r in batch:
                    producer.send(dst, key=r.key, value=r.value, headers=r.headers)
                copied += len(batch)
        producer.flush(timeout=60)
    finally:
        producer.close()
        consumer.close()


async def _copy_aiokafka(
    kafka: KafkaConfig, src: str, dst: str, count: int, per_poll: int, *, decode_each: bool = False
) -> tuple[float, int]:
    """Consume `count` messages of `src`, at most `per_poll` at a time, and produce them to
    `dst`; with `decode_each`, each is first decoded through the codec (validated), and its
    bytes are passed on. The CPU seconds spent after the first batch was acknowledged, and
    the messages copied in them (the stage's CPU is counted the same way: from its first
    output on, start-up excluded)."""
    from schemas.codec import decode
    from workers.kafka.clients import make_aio_consumer, make_aio_producer

    client_id = f"{kafka.client_id}-bench-copy"
    consumer = make_aio_consumer(kafka, src, group_id=None, client_id=client_id)
    producer = make_aio_producer(kafka, client_id=client_id)
    await consumer.start()
    await producer.start()
    copied, first, cpu = 0, 0, 0.0
    try:
        while copied < count:
            if not first and copied:
                first, cpu = copied, cpu_seconds()
            batches = await consumer.getmany(timeout_ms=500, max_records=per_poll)
            futures = []
            for batch in batches.values():
                for r in batch:
                    if decode_each:
                        decode(r.value)
                    futures.append(
                        await producer.send(dst, r.value, key=r.key, headers=list(r.headers))
                    )
                copied += len(batch)
            if futures:
                await asyncio.gather(*futures)
        cpu = cpu_seconds() - cpu
    finally:
        await producer.stop()
        await consumer.stop()
    return cpu, copied - first


async def _math_rate(workers: int, items: int) -> float:
    from workers.reward.pool import ScorerPool

    async with ScorerPool(workers) as pool:
        await pool.run("math", {"response": "\\boxed{1}", "ground_truth": "1"}, 60)  # warm
        started = time.perf_counter()
        jobs = [
            pool.run("math", {"response": r, "ground_truth": g}, 30)
            for r, g in (_MATH_ITEMS[i % len(_MATH_ITEMS)] for i in range(items))
        ]
        await asyncio.gather(*jobs)
        return items / (time.perf_counter() - started)


def _run_stage(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    tok_dir: str,
    tmp: Path,
    n: int,
    timeout: float,
    batch_size: int,
) -> float:
    """Run the stage until `n` outputs are on `rl.scored` (or `timeout`), then stop it; its
    CPU seconds per trajectory from its first output to its last (start-up, group join and
    table recovery excluded, like the rates)."""
    config = {
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "topics": {"prefix": topics.prefix},
        "reward": {
            "group_id": f"{topics.prefix}reward",
            "tokenizer": tok_dir,
            "data_sources": {"openai/gsm8k": "gsm8k"},
            "session_timeout_s": 10,
            "stats_path": str(tmp / "stats.json"),
            "batch_size": batch_size,
        },
    }
    path = tmp / "reward.yaml"
    path.write_text(json.dumps(config))
    with open(tmp / "worker.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli.main", "--config", str(path), "worker", "reward"],
            cwd=_REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        first = _await_count(kafka, topics.name("scored"), 1, timeout)
        cpu = cpu_seconds(proc.pid)
        _await_count(kafka, topics.name("scored"), n, timeout)
        cpu = cpu_seconds(proc.pid) - cpu
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return cpu / max(n - first, 1)


def run(
    kafka: KafkaConfig,
    *,
    trajectories: int = 2000,
    turns: int = 4,
    tokens: int = 256,
    math_items: int = 200,
    pool_workers: int = 2,
    batch_size: int = 1024,
    tokenizer: str | None = None,
    timeout_s: float = 600.0,
    runs: int = 3,
) -> dict[str, Any]:
    """Run the benchmark on `kafka` (topics under a fresh prefix, deleted afterwards)."""
    from transformers import AutoTokenizer

    if runs < 1:
        raise ValueError("runs must be at least 1")
    base = f"bench-{uuid.uuid4().hex[:8]}."
    topics = TopicsConfig(prefix=base)  # the copies' source and outputs
    # Each stage run reads its own copy of the turns (a fresh group, a fresh rl.scored).
    stage_topics = [TopicsConfig(prefix=f"{base}s{i}.") for i in range(runs)]
    copies = [f"{base}copy-kp", f"{base}copy-decode"] + [f"{base}copy-aio-{i}" for i in range(runs)]
    with tempfile.TemporaryDirectory(prefix="reward-bench-") as tmpdir:
        tmp = Path(tmpdir)
        if tokenizer is None:
            from pipeline.harness.models.tiny import build_tokenizer

            tokenizer = str(tmp / "tokenizer")
            build_tokenizer().save_pretrained(tokenizer)
        tok = AutoTokenizer.from_pretrained(tokenizer)
        events = _turns(tok, trajectories, turns, tokens)
        msgs = len(events)
        admin = _prepare(kafka, [topics, *stage_topics], copies, events)
        try:
            copy_cpu: dict[bool, list[float]] = {False: [], True: []}  # per trajectory

            def copy_aiokafka(dst: str, decode_each: bool = False) -> float:
                cpu, copied = asyncio.run(
                    _copy_aiokafka(
                        kafka, topics.name("turns"), dst, msgs, batch_size, decode_each=decode_each
                    )
                )
                copy_cpu[decode_each].append(cpu / max(copied / turns, 1))
                return _rate(_timestamps(kafka, dst, msgs, timeout_s))

            # Interleaved, the same number of times each: the machine's noise falls on both.
            aio_runs, stage_runs, stage_stats, stage_cpu = [], [], [], []
            for i, stage_topic in enumerate(stage_topics):
                aio_runs.append(copy_aiokafka(copies[2 + i]))
                work = tmp / f"stage-{i}"
                work.mkdir()
                stage_cpu.append(
                    _run_stage(
                        kafka, stage_topic, tokenizer, work, trajectories, timeout_s, batch_size
                    )
                )
                outputs = _timestamps(kafka, stage_topic.name("scored"), trajectories, timeout_s)
                stage_runs.append(_rate(outputs))
                stage_stats.append((len(outputs), json.loads((work / "stats.json").read_text())))
            decoding = copy_aiokafka(copies[1], decode_each=True)
            _copy_kafka_python(kafka, topics.name("turns"), copies[0], msgs, batch_size)
            kp = _rate(_timestamps(kafka, copies[0], msgs, timeout_s))
            math_rate = asyncio.run(_math_rate(pool_workers, math_items))
        finally:
            _cleanup(admin, base)
    aio, stage = max(aio_runs), max(stage_runs)
    best_run = stage_runs.index(stage)
    outputs_count, stats = stage_stats[best_run]
    best = max(kp, aio)
    copy_traj = best / turns
    # CPU per trajectory: the least of the runs on each side (the same statistic as the rates).
    cpu_stage, cpu_decoding = min(stage_cpu), min(copy_cpu[True])
    return {
        "trajectories": trajectories,
        "turns_per_trajectory": turns,
        "tokens_per_turn": tokens,
        "runs": runs,
        "stage_trajectories_per_s": round(stage, 1),
        "stage_runs_trajectories_per_s": [round(r, 1) for r in stage_runs],
        "stage_outputs": outputs_count,
        "copy_kafka_python_msgs_per_s": round(kp, 1),
        "copy_aiokafka_msgs_per_s": round(aio, 1),
        "copy_aiokafka_runs_msgs_per_s": [round(r, 1) for r in aio_runs],
        "copy_best_client": "kafka-python" if kp >= aio else "aiokafka",
        "copy_trajectories_per_s": round(copy_traj, 1),
        "ratio": round(stage / copy_traj, 3) if copy_traj else 0.0,
        "ratio_of_medians": round(
            statistics.median(stage_runs) / (statistics.median(aio_runs) / turns), 3
        )
        if min(aio_runs) > 0
        else 0.0,
        "target_ratio": 0.5,
        "copy_decoding_msgs_per_s": round(decoding, 1),
        "ratio_to_decoding_copy": round(stage / (decoding / turns), 3) if decoding else 0.0,
        "cpu_s_per_trajectory": {
            "stage": round(cpu_stage, 6),
            "stage_runs": [round(c, 6) for c in stage_cpu],
            "copy_aiokafka": round(min(copy_cpu[False]), 6),
            "copy_decoding": round(cpu_decoding, 6),
        },
        "trajectories_per_core_s": {
            "stage": round(per_core_rate(1, cpu_stage), 1),
            "copy_decoding": round(per_core_rate(1, cpu_decoding), 1),
        },
        # The same comparison in CPU, which the machine's other load moves far less.
        "cpu_ratio_to_decoding_copy": round(cpu_decoding / cpu_stage, 3) if cpu_stage else 0.0,
        "math_verify_items_per_s": round(math_rate, 1),
        "pool_workers": pool_workers,
        "batch_size": batch_size,
        "stage_seconds": {k: v for k, v in stats.items() if k.startswith("t_")},
        "stage_batches": stats.get("batches"),
    }


def _prepare(
    kafka: KafkaConfig, topic_sets: list[TopicsConfig], copies: list[str], events: list[TurnEvent]
) -> Any:
    """Create every topic and write the turns to each set's turns topic; the admin client."""
    from pipeline.topics import create_topics, replication
    from workers.kafka.admin import TopicLayout, ensure_topics
    from workers.kafka.clients import make_admin, make_producer

    for topic_set in topic_sets:
        create_topics(kafka, topic_set)
    first = topic_sets[0]
    layout = (first.scored.partitions, replication(kafka, first)[0])
    ensure_topics(kafka, [TopicLayout(c, *layout) for c in copies])
    admin = make_admin(kafka)
    producer = make_producer(kafka, name="bench")
    values = [(e.trajectory_id, encode(e), headers_for(e)) for e in events]
    for topic_set in topic_sets:
        for key, value, headers in values:
            producer.send(topic_set.name("turns"), key=key, value=value, headers=headers)
    producer.flush(timeout=300)
    producer.close()
    return admin


def _cleanup(admin: Any, prefix: str) -> None:
    """Delete every topic the run made (its own, the stages' and their internal ones)."""
    try:
        made = [t for t in admin.list_topics() if t.startswith(prefix)]
        if made:
            admin.delete_topics(made)
    finally:
        admin.close()
