"""The reward stage against the real broker, run as a subprocess (`rollout worker reward`).

Turn events are produced by the tests (the agent-loop worker is not in the tree yet), which
also lets them produce the edge cases on purpose: attempts out of order, duplicate
completions, a middle turn arriving late, undecodable bytes, an unknown data_source.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.codec import decode, encode, headers_for
from schemas.deadletter import DeadLetter
from schemas.events import ExtraFields, RewardModelSpec, ScoredTrajectory, TurnEvent
from schemas.headers import TRAJECTORY_ID
from tests.conftest import REPO, ROLLOUT
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.harness.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


class Worker:
    """`rollout worker reward` with a config file of this test; killed on exit."""

    def __init__(
        self, tmp: Path, kafka: KafkaConfig, topics: TopicsConfig, tokenizer_dir: Path
    ) -> None:
        self.tmp = tmp
        self.stats_path = tmp / "stats.json"
        self.config = tmp / "reward.yaml"
        reward = {
            "group_id": f"{topics.prefix}reward",
            "tokenizer": str(tokenizer_dir),
            "stats_path": str(self.stats_path),
            "session_timeout_s": 6,
            "commit_interval_s": 1.0,
            "pool_workers": 1,
            "batch_size": 64,
        }
        self.config.write_text(
            json.dumps(
                {
                    "kafka": {"bootstrap_servers": kafka.bootstrap},
                    "topics": {"prefix": topics.prefix},
                    "reward": reward,
                }
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def configure(self, **reward: Any) -> None:
        """Change settings of the reward section (before `start`)."""
        data = json.loads(self.config.read_text())
        data["reward"].update(reward)
        self.config.write_text(json.dumps(data))

    def start(self) -> None:
        self.runs += 1
        log = open(self.tmp / f"worker-{self.runs}.log", "wb")
        self.proc = subprocess.Popen(
            [*ROLLOUT, "--config", str(self.config), "-v", "worker", "reward"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def stats(self) -> dict[str, Any]:
        return json.loads(self.stats_path.read_text()) if self.stats_path.exists() else {}

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self) -> str:
        return (self.tmp / f"worker-{self.runs}.log").read_text(errors="replace")[-4000:]


@pytest.fixture
def worker(
    tmp_path: Path, kafka_config: KafkaConfig, topics_config: TopicsConfig, tokenizer_dir: Path
) -> Iterator[Worker]:
    w = Worker(tmp_path, kafka_config, topics_config, tokenizer_dir)
    try:
        yield w
    finally:
        w.kill()


def make_turns(
    tokenizer: Any,
    uid: str,
    texts: list[str],
    *,
    truth: str,
    attempt: str = "a",
    data_source: str = "openai/gsm8k",
    sample: int = 0,
) -> list[TurnEvent]:
    out = []
    last = len(texts) - 1
    for index, text in enumerate(texts):
        ids = tokenizer.encode(text)
        role = "assistant" if index % 2 == 0 else "tool"
        first, final = index == 0, index == last
        out.append(
            TurnEvent(
                trajectory_id=f"{uid}/{sample}",
                uid=uid,
                sample_index=sample,
                attempt_id=attempt,
                turn_index=index,
                role=role,
                token_ids=ids,
                logprobs=[-0.5] * len(ids) if role == "assistant" else None,
                min_global_steps=1 + index,
                max_global_steps=2 + index,
                final=final,
                prompt_ids=tokenizer.encode("question?") if first else None,
                data_source=data_source if first else None,
                reward_model=RewardModelSpec(ground_truth=truth) if first else None,
                tool_reward=0.5 if role == "tool" else None,
                num_turns=len(texts) + 1 if final else None,
                extra_fields=(
                    ExtraFields(min_global_steps=1, max_global_steps=2 + last) if final else None
                ),
            )
        )
    return out


def produce(kafka: KafkaConfig, topic: str, events: list[TurnEvent | tuple[str, bytes]]) -> None:
    producer = make_producer(kafka)
    try:
        for event in events:
            if isinstance(event, tuple):
                producer.send(topic, key=event[0], value=event[1])
            else:
                producer.send(
                    topic, key=event.trajectory_id, value=encode(event), headers=headers_for(event)
                )
        producer.flush(timeout=30)
    finally:
        producer.close()


def read_all(
    kafka: KafkaConfig, topic: str, *, until: Callable[[list[Any]], bool], timeout: float
) -> list[Any]:
    consumer = make_consumer(kafka, topic, group_id=None)
    records: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not until(records):
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    return records


def test_edge_cases_become_exactly_one_scored_trajectory_each(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig, tokenizer: Any
) -> None:
    t = tokenizer
    ok = make_turns(t, "ok", ["thinking", "tool says 6", "so #### 1,234"], truth="1234")
    wrong = make_turns(t, "wrong", ["#### 5"], truth="6")
    a = make_turns(t, "race", ["a0", "a1", "#### 1"], truth="2", attempt="a")
    b = make_turns(t, "race", ["b0", "b1", "#### 2"], truth="2", attempt="b")
    first = make_turns(t, "dup", ["#### -3"], truth="-3", attempt="first")
    second = make_turns(t, "dup", ["#### 9"], truth="-3", attempt="second")
    late = make_turns(t, "late", ["x", "y", "#### 0.50"], truth="0.5")
    unknown = make_turns(t, "unk", ["#### 1"], truth="1", data_source="no/such-set")
    math = make_turns(t, "math", ["so \\boxed{\\frac{1}{2}}"], truth="0.5", data_source="math")
    events: list[Any] = [
        *ok, *wrong,
        a[0], a[1], b[0], a[2], b[1], b[2],  # newer attempt replaces; old final is stale
        *first, *second,  # a completion after the trajectory is scored is dropped
        late[0], late[2], late[1],  # missing middle turn arrives late
        *unknown, ("junk", b"\x00 not an event"), *math,
    ]  # fmt: skip
    produce(kafka_config, topics_config.name("turns"), events)
    worker.start()
    scored = read_all(
        kafka_config, topics_config.name("scored"), until=lambda r: len(r) >= 6, timeout=120
    )
    dead = read_all(
        kafka_config, topics_config.name("dlq"), until=lambda r: len(r) >= 2, timeout=30
    )
    time.sleep(2)  # anything extra (a duplicate) would arrive by now
    scored = read_all(kafka_config, topics_config.name("scored"), until=lambda r: False, timeout=3)
    assert len(scored) >= 6, worker.log_tail()
    by_id = {}
    for record in scored:
        event = decode(record.value)
        assert isinstance(event, ScoredTrajectory)
        assert event.trajectory_id not in by_id, f"{event.trajectory_id} emitted twice"
        assert record.key == event.uid.encode()
        assert dict(record.headers)[TRAJECTORY_ID] == event.trajectory_id.encode()
        by_id[event.trajectory_id] = event
    assert {k: v.reward_score for k, v in by_id.items()} == {
        "ok/0": 1.0,
        "wrong/0": 0.0,
        "race/0": 1.0,
        "dup/0": 1.0,
        "late/0": 1.0,
        "math/0": 1.0,
    }
    assert by_id["race/0"].attempt_id == "b" and by_id["dup/0"].attempt_id == "first"
    okt = by_id["ok/0"]
    assert okt.num_turns == 4 and okt.tool_rewards == [0.5]
    assert okt.response_mask.sum() == len(t.encode("thinking")) + len(t.encode("so #### 1,234"))
    assert (okt.extra_fields.min_global_steps, okt.extra_fields.max_global_steps) == (1, 4)
    assert by_id["math/0"].reward_extra["scorer"] == "math"
    letters = [DeadLetter.from_message(list(r.headers), r.key, r.value) for r in dead]
    assert sorted(letter.error_cause for letter in letters) == ["json", "unknown_data_source"]
    unk = next(letter for letter in letters if letter.error_cause == "unknown_data_source")
    assert decode(unk.value).trajectory_id == "unk/0" and unk.stage == "reward"
    stats = worker.stats()
    assert stats["duplicate_completion"] >= 1 and stats["stale_attempt"] >= 1
    assert stats["decode_errors"] == 1 and stats["scored"] == 6


@pytest.mark.slow
def test_sigkill_mid_stream_loses_nothing_and_emits_nothing_twice(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig, tokenizer: Any
) -> None:
    n = 240
    turns_topic = topics_config.name("turns")
    trajectories = [
        make_turns(
            tokenizer, f"k{i}", ["step", "tool", "more", f"#### {i}"], truth=str(i if i % 3 else -1)
        )
        for i in range(n)
    ]

    def feed() -> None:  # a steady stream, so the kill lands mid-stream
        for start in range(0, n, 10):
            produce(
                kafka_config,
                turns_topic,
                [e for traj in trajectories[start : start + 10] for e in traj],
            )
            time.sleep(0.25)

    feeder = threading.Thread(target=feed, daemon=True)
    worker.start()
    feeder.start()
    first = read_all(
        kafka_config, topics_config.name("scored"), until=lambda r: len(r) >= n // 3, timeout=120
    )
    assert len(first) >= n // 3, worker.log_tail()
    worker.kill(signal.SIGKILL)
    stats_before = worker.stats()
    worker.start()
    feeder.join(timeout=120)
    records = read_all(
        kafka_config, topics_config.name("scored"), until=lambda r: len(r) >= n, timeout=150
    )
    time.sleep(3)  # anything extra (a duplicate) would arrive by now
    records = read_all(kafka_config, topics_config.name("scored"), until=lambda r: False, timeout=4)
    ids = Counter(decode(r.value).trajectory_id for r in records)
    assert len(ids) == n, f"missing {n - len(ids)}\n{worker.log_tail()}"
    assert max(ids.values()) == 1, f"duplicates: {[k for k, c in ids.items() if c > 1]}"
    for record in records:
        event = decode(record.value)
        i = int(event.uid[1:])
        assert event.reward_score == (1.0 if i % 3 else 0.0)
    after = worker.stats()
    print(f"before kill: {stats_before}\nafter restart: {after}")
    assert after.get("scored", 0) + stats_before.get("scored", 0) >= n
    assert os.path.exists(worker.stats_path)


@pytest.mark.parametrize("committed", [True, False], ids=["recovery-point", "never-committed"])
def test_outputs_of_an_uncommitted_batch_are_not_emitted_again(
    committed: bool,
    worker: Worker,
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    tokenizer: Any,
) -> None:
    """A stage died after its outputs were acknowledged, before its DONE states and offsets.

    The test plays that stage: `gone/0`'s output is on rl.scored, its turns are not
    committed, and (with a commit) the recovery point is where rl.scored ended before the
    output. The restarted stage must find it there and emit only `new/0`.
    """
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    from workers.reward.ledger import format_recovery_point

    scored_topic = topics_config.name("scored")
    partitions = topics_config.scored.partitions
    if committed:
        consumer = KafkaConsumer(
            bootstrap_servers=kafka_config.bootstrap,
            group_id=f"{topics_config.prefix}reward",
            enable_auto_commit=False,
        )
        point = format_recovery_point(dict.fromkeys(range(partitions), 0))
        turns_partitions = range(topics_config.turns.partitions)
        consumer.commit(
            {
                TopicPartition(topics_config.name("turns"), p): OffsetAndMetadata(0, point, -1)
                for p in turns_partitions
            }
        )
        consumer.close()
    gone = make_turns(tokenizer, "gone", ["a", "#### 1"], truth="1")
    new = make_turns(tokenizer, "new", ["b", "#### 2"], truth="2")
    earlier = ScoredTrajectory(
        uid="gone",
        trajectory_id="gone/0",
        sample_index=0,
        attempt_id="a",
        data_source="x",
        prompt_ids=[1],
        response_ids=[2],
        response_mask=[1],
        response_logprobs=[-0.5],
        num_turns=3,
        reward_score=1.0,
        extra_fields=ExtraFields(min_global_steps=1, max_global_steps=1),
    )
    producer = make_producer(kafka_config)
    producer.send(
        scored_topic,
        key=b"gone",
        value=encode(earlier),
        headers=[*headers_for(earlier), (TRAJECTORY_ID, b"gone/0")],
    )
    producer.flush(timeout=30)
    producer.close()
    produce(kafka_config, topics_config.name("turns"), [*gone, *new])
    worker.start()
    records = read_all(kafka_config, scored_topic, until=lambda r: len(r) >= 2, timeout=90)
    time.sleep(3)  # a second `gone/0` would arrive by now
    records = read_all(kafka_config, scored_topic, until=lambda r: False, timeout=3)
    ids = Counter(decode(r.value).trajectory_id for r in records)
    assert ids == {"gone/0": 1, "new/0": 1}, worker.log_tail()
    stats = worker.stats()
    assert stats["emit_recovered_present"] == 1 and stats["scored"] == 1, stats


def test_done_states_are_deleted_after_their_retention(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig, tokenizer: Any
) -> None:
    """DONE states do not pile up: past `done_retention_s` the next batch deletes them from
    the table and writes a tombstone to the changelog (so compaction drops them too)."""
    worker.configure(done_retention_s=2.0)
    turns_topic, scored_topic = topics_config.name("turns"), topics_config.name("scored")
    worker.start()
    produce(kafka_config, turns_topic, make_turns(tokenizer, "old", ["#### 1"], truth="1"))
    assert len(read_all(kafka_config, scored_topic, until=lambda r: len(r) >= 1, timeout=90)) == 1
    time.sleep(3)
    produce(kafka_config, turns_topic, make_turns(tokenizer, "next", ["#### 2"], truth="2"))
    assert len(read_all(kafka_config, scored_topic, until=lambda r: len(r) >= 2, timeout=60)) == 2
    changelog = f"{topics_config.prefix}reward-trajectories-changelog"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        writes = [
            r.value
            for r in read_all(kafka_config, changelog, until=lambda r: False, timeout=2)
            if r.key == b"old/0"
        ]
        if writes and writes[-1] is None:
            break
    assert writes and writes[-1] is None, f"old/0 writes: {writes}\n{worker.log_tail()}"
    assert b'"s":"done"' in writes[-2]  # the DONE state, then its tombstone
    assert worker.stats().get("done_expired", 0) >= 1


def test_abandoned_trajectories_go_to_the_dead_letters_turn_by_turn(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig, tokenizer: Any
) -> None:
    """A trajectory that stops receiving turns before its final one does not sit in the
    table for ever: past `abandon_after_s` each of its turns goes to rl.dlq byte for byte
    (cause `abandoned`) and its state is deleted; a trajectory that kept going is scored."""
    worker.configure(abandon_after_s=6.0)
    turns_topic = topics_config.name("turns")
    stuck = make_turns(tokenizer, "stuck", ["step", "tool", "#### 3"], truth="3")
    slow = make_turns(tokenizer, "slow", ["step", "tool", "#### 4"], truth="4")

    def feed(events: list[TurnEvent]) -> None:  # and wait for the batch that takes them
        seen = worker.stats().get("turns", 0)
        produce(kafka_config, turns_topic, events)
        deadline = time.monotonic() + 60
        while worker.stats().get("turns", 0) < seen + len(events):
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.1)

    worker.start()
    feed([stuck[0], stuck[1], slow[0]])
    taken = time.monotonic()
    # Gaps of about half the bound for "slow", so a loaded machine's seconds of latency on
    # a feed cannot push it past the bound (at 2.5 s of a 3 s bound, they once did).
    time.sleep(3.0)
    feed([slow[1]])  # "slow" has a new turn 3 s later, "stuck" none
    time.sleep(max(0.0, taken + 6.5 - time.monotonic()))
    feed([slow[2]])  # this batch abandons "stuck" (6.5 s idle), not "slow" (3.5 s + latency)
    scored = read_all(
        kafka_config, topics_config.name("scored"), until=lambda r: len(r) >= 1, timeout=60
    )
    assert [decode(r.value).trajectory_id for r in scored] == ["slow/0"], worker.log_tail()
    dead = read_all(
        kafka_config, topics_config.name("dlq"), until=lambda r: len(r) >= 2, timeout=30
    )
    letters = [DeadLetter.from_message(list(r.headers), r.key, r.value) for r in dead]
    assert [letter.error_cause for letter in letters] == ["abandoned", "abandoned"], letters
    assert sorted(letter.value for letter in letters) == sorted(encode(t) for t in stuck[:2])
    assert all(letter.key == b"stuck/0" for letter in letters)
    assert "turns [0, 1] and no final turn" in letters[0].error_message
    changelog = f"{topics_config.prefix}reward-trajectories-changelog"
    writes = [
        r.value
        for r in read_all(kafka_config, changelog, until=lambda r: False, timeout=3)
        if r.key == b"stuck/0"
    ]
    assert writes and writes[-1] is None, writes  # deleted from the changelog too
    assert worker.stats().get("abandoned") == 1


def test_an_idle_stage_still_abandons_and_expires(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig, tokenizer: Any
) -> None:
    """No turn arrives after the first ones: the sweep every `sweep_interval_s` still
    abandons the stuck trajectory and deletes the scored one's DONE state."""
    worker.configure(abandon_after_s=2.0, done_retention_s=2.0, sweep_interval_s=0.5)
    stuck = make_turns(tokenizer, "idle-stuck", ["step", "#### 3"], truth="3")
    done = make_turns(tokenizer, "idle-done", ["#### 4"], truth="4")
    worker.start()
    produce(kafka_config, topics_config.name("turns"), [stuck[0], *done])
    dead = read_all(
        kafka_config, topics_config.name("dlq"), until=lambda r: len(r) >= 1, timeout=60
    )
    letters = [DeadLetter.from_message(list(r.headers), r.key, r.value) for r in dead]
    assert [(x.error_cause, x.key, x.value) for x in letters] == [
        ("abandoned", b"idle-stuck/0", encode(stuck[0]))
    ], worker.log_tail()
    scored = read_all(
        kafka_config, topics_config.name("scored"), until=lambda r: len(r) >= 1, timeout=30
    )
    assert [decode(r.value).trajectory_id for r in scored] == ["idle-done/0"]
    changelog = f"{topics_config.prefix}reward-trajectories-changelog"

    def last_writes(records: list[Any]) -> dict[bytes, bytes | None]:
        return {r.key: r.value for r in records}

    writes = last_writes(
        read_all(
            kafka_config,
            changelog,
            timeout=30,
            until=lambda r: all(
                last_writes(r).get(k, b"") is None for k in (b"idle-stuck/0", b"idle-done/0")
            ),
        )
    )
    assert writes.get(b"idle-stuck/0", b"") is None and writes.get(b"idle-done/0", b"") is None
    stats = worker.stats()
    assert stats.get("abandoned") == 1 and stats.get("done_expired") == 1, stats
    assert stats.get("turns") == 2 and stats.get("sweeps", 0) >= 1, stats  # sweeps aren't batches


@pytest.mark.slow
def test_partitions_move_between_two_workers_mid_stream(
    tmp_path: Path,
    worker: Worker,
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    tokenizer_dir: Path,
    tokenizer: Any,
) -> None:
    """A second worker joins mid-stream, then the first leaves (SIGTERM): every rebalance
    settles the batches in flight and commits with a recovery point, and the new owner picks
    up half-assembled trajectories from the changelog. Every trajectory comes out once."""
    n = 160
    turns_topic = topics_config.name("turns")
    trajectories = [
        make_turns(tokenizer, f"m{i}", ["step", "tool", "more", f"#### {i}"], truth=str(i))
        for i in range(n)
    ]

    released = threading.Event()

    def feed() -> None:  # turns 0-1 of a slice, then turns 2-3: states span batches
        for start in range(0, n, 8):
            part = trajectories[start : start + 8]
            produce(kafka_config, turns_topic, [e for traj in part for e in traj[:2]])
            if start == 3 * n // 4:
                # The last quarter's rest waits for the first worker to leave, so the second
                # finishes trajectories the first began (on a loaded machine the first could
                # otherwise score everything before the second is assigned anything).
                released.wait(timeout=240)
            time.sleep(0.15)
            produce(kafka_config, turns_topic, [e for traj in part for e in traj[2:]])
            time.sleep(0.15)

    second_dir = tmp_path / "second"
    second_dir.mkdir()
    second = Worker(second_dir, kafka_config, topics_config, tokenizer_dir)
    feeder = threading.Thread(target=feed, daemon=True)
    worker.start()
    feeder.start()
    scored_topic = topics_config.name("scored")
    try:
        read_all(kafka_config, scored_topic, until=lambda r: len(r) >= n // 4, timeout=120)
        second.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "] assigned" not in second.log_tail():
            time.sleep(0.5)
        assert "] assigned" in second.log_tail(), second.log_tail()
        read_all(kafka_config, scored_topic, until=lambda r: len(r) >= n // 2, timeout=120)
        worker.kill(signal.SIGTERM)
        released.set()
        feeder.join(timeout=120)
        records = read_all(kafka_config, scored_topic, until=lambda r: len(r) >= n, timeout=150)
        time.sleep(3)  # anything extra (a duplicate) would arrive by now
        records = read_all(kafka_config, scored_topic, until=lambda r: False, timeout=4)
    finally:
        released.set()
        second.kill()
    ids = Counter(decode(r.value).trajectory_id for r in records)
    assert len(ids) == n, f"missing {n - len(ids)}\n{second.log_tail()}"
    assert max(ids.values()) == 1, f"duplicates: {[k for k, c in ids.items() if c > 1]}"
    assert second.stats().get("scored", 0) > 0
