"""The replay stage against the real broker, run as a subprocess (`rollout worker replay`).

Scored trajectories are produced by the tests, which lets them produce the edge cases on
purpose: samples out of order and duplicated, a group too stale for the published policy
version, a zero-variance group, a group that never completes, undecodable bytes, an event
of the wrong kind, a key that is not the uid; and a SIGKILL mid-stream.
"""

from __future__ import annotations

import json
import random
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
from schemas.events import EventBase, PolicyVersion, PromptEvent, ScoredTrajectory, TrainingGroup
from schemas.headers import DROP_REASON, STALENESS
from tests.conftest import REPO, ROLLOUT
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class Worker:
    """`rollout worker replay` with a config file of this test; killed on exit."""

    def __init__(self, tmp: Path, kafka: KafkaConfig, topics: TopicsConfig) -> None:
        self.tmp, self.kafka, self.topics = tmp, kafka, topics
        self.stats_path = tmp / "stats.json"
        self.config = tmp / "replay.yaml"
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def configure(self, max_staleness: int | None = None, **replay: Any) -> None:
        """The replay section of the worker's config; `max_staleness` is the run's (the
        trainer's), which the replay stage derives its own from."""
        settings = {
            "group_id": f"{self.topics.prefix}replay",
            "stats_path": str(self.stats_path),
            "session_timeout_s": 6,
            "commit_interval_s": 1.0,
            "sweep_interval_s": 1.0,
            "batch_size": 64,
            **replay,
        }
        self.config.write_text(
            json.dumps(
                {
                    "kafka": {"bootstrap_servers": self.kafka.bootstrap},
                    "topics": {"prefix": self.topics.prefix},
                    "replay": settings,
                    "trainer": {"max_staleness": max_staleness},
                }
            )
        )

    def start(self) -> None:
        self.runs += 1
        log = open(self.tmp / f"worker-{self.runs}.log", "wb")
        self.proc = subprocess.Popen(
            [*ROLLOUT, "--config", str(self.config), "-v", "worker", "replay"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def dead(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

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
    tmp_path: Path, kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> Iterator[Worker]:
    w = Worker(tmp_path, kafka_config, topics_config)
    try:
        yield w
    finally:
        w.kill()


def scored(
    uid: str, index: int, reward: float, low: int = 0, high: int | None = None
) -> ScoredTrajectory:
    return ScoredTrajectory(
        uid=uid,
        trajectory_id=f"{uid}/{index}",
        sample_index=index,
        attempt_id="a",
        data_source="openai/gsm8k",
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        response_mask=[1, 1],
        response_logprobs=[-0.1, -0.2],
        num_turns=2,
        reward_score=reward,
        extra_fields={"min_global_steps": low, "max_global_steps": low if high is None else high},
    )


Item = EventBase | tuple[str | None, bytes]


def produce(kafka: KafkaConfig, topic: str, items: list[Item]) -> None:
    producer = make_producer(kafka)
    try:
        for item in items:
            if isinstance(item, tuple):
                producer.send(topic, key=item[0], value=item[1])
            else:
                key = getattr(item, "uid", None) or "policy"
                producer.send(topic, key=key, value=encode(item), headers=headers_for(item))
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


def groups_of(records: list[Any]) -> dict[str, tuple[TrainingGroup, dict[str, bytes]]]:
    """uid → (group, headers); fails on a uid seen twice."""
    out: dict[str, tuple[TrainingGroup, dict[str, bytes]]] = {}
    for record in records:
        group = decode(record.value)
        assert isinstance(group, TrainingGroup)
        assert record.key == group.uid.encode()
        assert group.uid not in out, f"{group.uid} emitted twice"
        out[group.uid] = (group, dict(record.headers))
    return out


def test_groups_staleness_zero_variance_timeout_and_dead_letters(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    t = topics_config
    produce(kafka_config, t.name("policy"), [PolicyVersion(version=10, path="/ckpt/10")])
    good = [scored("good", i, r, low=9, high=10) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    skew = [scored("skew", i, r, low=10) for i, r in enumerate([3.0, 0.0, 0.0, 0.0])]
    old = [scored("old", i, r, low=5, high=9) for i, r in enumerate([1.0, 0.0, 1.0, 0.0])]
    flat = [scored("flat", i, 1.0, low=10) for i in range(4)]
    part = [scored("part", i, r, low=10) for i, r in enumerate([1.0, 0.0])]
    prompt = PromptEvent(uid="p", prompt=[{"role": "user", "content": "hi"}], data_source="x")
    items: list[Item] = [
        good[3],
        skew[0],
        good[1],
        old[0],
        flat[0],
        part[0],
        good[1],  # duplicate
        ("junk", b"\x00 not an event"),
        old[1],
        skew[1],
        flat[1],
        flat[2],
        old[2],
        good[0],
        prompt,
        ("not-the-uid", encode(scored("keyed", 0, 1.0))),
        skew[2],
        part[1],
        good[3],
        old[3],
        flat[3],
        skew[3],
        good[2],
        skew[0],  # duplicate after completion
    ]
    produce(kafka_config, t.name("scored"), items)
    worker.configure(
        n=4,
        group_timeout_s=6,
        partial_policy="emit",
        max_staleness=2,
        stale_policy="drop",
        drop_zero_variance=True,
        norm_adv_by_std=True,
    )
    worker.start()

    replay = read_all(
        kafka_config, t.name("replay"), until=lambda r: len(r) >= 3 or worker.dead(), timeout=90
    )
    stale = read_all(kafka_config, t.name("stale"), until=lambda r: len(r) >= 2, timeout=20)
    dead = read_all(kafka_config, t.name("dlq"), until=lambda r: len(r) >= 3, timeout=20)
    time.sleep(3)  # anything extra (a duplicate) would arrive by now
    replay = read_all(kafka_config, t.name("replay"), until=lambda r: False, timeout=3)
    stale = read_all(kafka_config, t.name("stale"), until=lambda r: False, timeout=3)

    emitted = groups_of(replay)
    assert sorted(emitted) == ["good", "part", "skew"], worker.log_tail()
    g, headers = emitted["good"]
    assert [s.sample_index for s in g.samples] == [0, 1, 2, 3]
    std = (4 * 0.25 / 3) ** 0.5  # [1, 0, 0, 1]: mean .5, sample std sqrt(1/3)
    assert g.advantages == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], abs=1e-4)
    assert (g.min_global_steps, g.max_global_steps, g.emitted_at_version) == (9, 10, 10)
    assert headers[STALENESS] == b"1" and DROP_REASON not in headers
    s, _ = emitted["skew"]  # mean .75, sample std sqrt(27/12) = 1.5
    std = 1.5
    assert s.advantages == pytest.approx(
        [2.25 / std, -0.75 / std, -0.75 / std, -0.75 / std], abs=1e-4
    )
    p, _ = emitted["part"]  # timed out with 2 of 4: emitted partial
    assert [x.sample_index for x in p.samples] == [0, 1]
    assert p.advantages == pytest.approx([0.5**0.5, -(0.5**0.5)], abs=1e-4)

    dropped = groups_of(stale)
    assert {uid: h[DROP_REASON] for uid, (_, h) in dropped.items()} == {
        "old": b"stale",
        "flat": b"zero_variance",
    }
    assert dropped["old"][1][STALENESS] == b"5"
    assert len(dropped["flat"][0].samples) == 4

    letters = [DeadLetter.from_message(list(r.headers), r.key, r.value) for r in dead]
    assert sorted(x.error_cause for x in letters) == ["json", "key_mismatch", "wrong_kind"]
    assert {x.stage for x in letters} == {"replay"}
    assert all(x.topic == t.name("scored") for x in letters)

    stats = worker.stats()
    assert stats["duplicates"] == 3 and stats["decode_errors"] == 3
    assert stats["groups_complete"] == 4 and stats["groups_partial"] == 1
    assert stats["emitted"] == 3 and stats["dropped_stale"] == 1
    assert stats["dropped_zero_variance"] == 1
    assert stats["staleness"] == {"0": 3, "1": 1, "5": 1} and stats["policy_version"] == 10

    # A late sample of a finished group, and a duplicate: counted, nothing emitted.
    produce(kafka_config, t.name("scored"), [scored("good", 7, 1.0, low=10), good[0]])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and worker.stats().get("late_samples", 0) < 1:
        time.sleep(0.5)
    stats = worker.stats()
    assert stats["late_samples"] == 1 and stats["duplicates"] == 4
    assert len(read_all(kafka_config, t.name("replay"), until=lambda r: False, timeout=2)) == 3


def test_sigkill_mid_stream_loses_nothing_and_emits_nothing_twice(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    n, groups = 4, 60
    scored_topic = topics_config.name("scored")
    rng = random.Random(7)
    rewards = {
        f"k{i}": [float((i + j) % 3 == 0) + 0.1 * j for j in range(n)] for i in range(groups)
    }
    samples = [scored(uid, j, r[j], low=3) for uid, r in rewards.items() for j in range(n)]
    rng.shuffle(samples)  # groups complete out of order, their samples interleaved
    samples += rng.sample(samples, 20)  # redeliveries
    produce(kafka_config, topics_config.name("policy"), [PolicyVersion(version=4, path="/c/4")])
    lonely = scored("lonely", 0, 1.0, low=4)  # never completes: dropped by the timeout

    def feed() -> None:  # a steady stream, so the kill lands mid-stream
        for start in range(0, len(samples), 10):
            produce(kafka_config, scored_topic, list(samples[start : start + 10]))
            time.sleep(0.15)
        produce(kafka_config, scored_topic, [lonely])

    worker.configure(
        n=n, group_timeout_s=30, partial_policy="drop", norm_adv_by_std=False, batch_size=16
    )
    feeder = threading.Thread(target=feed, daemon=True)
    worker.start()
    feeder.start()
    first = read_all(
        kafka_config,
        topics_config.name("replay"),
        until=lambda r: len(r) >= groups // 3,
        timeout=90,
    )
    assert len(first) >= groups // 3, worker.log_tail()
    worker.kill(signal.SIGKILL)
    before = worker.stats()
    worker.start()
    feeder.join(timeout=120)
    records = read_all(
        kafka_config, topics_config.name("replay"), until=lambda r: len(r) >= groups, timeout=90
    )
    stale = read_all(
        kafka_config, topics_config.name("stale"), until=lambda r: len(r) >= 1, timeout=60
    )
    time.sleep(3)  # anything extra (a duplicate) would arrive by now
    records = read_all(kafka_config, topics_config.name("replay"), until=lambda r: False, timeout=3)
    after = worker.stats()
    print(f"before kill: {before}\nafter restart: {after}")

    counts = Counter(decode(r.value).uid for r in records)
    assert max(counts.values()) == 1, f"duplicates: {[k for k, c in counts.items() if c > 1]}"
    assert set(counts) == set(rewards), f"missing {set(rewards) - set(counts)}\n{worker.log_tail()}"
    for uid, (group, _) in groups_of(records).items():
        assert [s.sample_index for s in group.samples] == list(range(n))
        mean = sum(rewards[uid]) / n
        assert group.advantages == pytest.approx([r - mean for r in rewards[uid]], abs=1e-6)
    assert {uid: h[DROP_REASON] for uid, (_, h) in groups_of(stale).items()} == {
        "lonely": b"timeout"
    }


def test_restart_resolves_emitting_markers_left_by_a_crash(
    worker: Worker, kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    """The table as a crash between marker and DONE leaves it: one output landed, one not."""
    from aiokafka.partitioner import murmur2
    from kafka.admin import NewTopic

    from workers.kafka.clients import make_admin
    from workers.replay.state import GroupState, group_key, sample_key

    def partition(uid: str) -> int:  # every topic of the test has 4 partitions
        return (murmur2(uid.encode()) & 0x7FFFFFFF) % 4

    group_id = f"{topics_config.prefix}replay"
    changelog = f"{group_id}-groups-changelog"
    admin = make_admin(kafka_config)
    try:  # what the first run would have created
        admin.create_topics(
            [NewTopic(changelog, 4, 1, topic_configs={"cleanup.policy": "compact"})],
            wait_for_metadata=True,
        )
    finally:
        admin.close()
    samples = {
        uid: [scored(uid, i, float(i % 2), low=1) for i in range(4)] for uid in ("landed", "ghost")
    }
    producer = make_producer(kafka_config)
    try:
        for uid, group in samples.items():
            p = partition(uid)
            for sample in group:
                producer.send(
                    changelog,
                    key=sample_key(sample.trajectory_id),
                    value=encode(sample),
                    partition=p,
                )
            state = GroupState(
                uid=uid, partition=p, first_seen=time.time(), expected=4, indices=[0, 1, 2, 3]
            )
            state.mark_emitting("replay", partition(uid), 0)
            producer.send(changelog, key=group_key(uid), value=state.to_bytes(), partition=p)
        landed = TrainingGroup(
            uid="landed",
            samples=samples["landed"],
            advantages=[-1.0, 1.0, -1.0, 1.0],
            min_global_steps=1,
            max_global_steps=1,
            emitted_at_version=0,
        )
        producer.send(
            topics_config.name("replay"),
            key="landed",
            value=encode(landed),
            partition=partition("landed"),
        )
        producer.flush(timeout=30)
    finally:
        producer.close()

    worker.configure(n=4)
    worker.start()
    records = read_all(
        kafka_config,
        topics_config.name("replay"),
        until=lambda r: len(r) >= 2 or worker.dead(),
        timeout=60,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and worker.stats().get("emit_recovered_present", 0) < 1:
        time.sleep(0.5)
    time.sleep(2)
    records = read_all(kafka_config, topics_config.name("replay"), until=lambda r: False, timeout=3)
    emitted = groups_of(records)
    assert sorted(emitted) == ["ghost", "landed"], worker.log_tail()
    a = 0.5 / (1 / 3) ** 0.5  # [0, 1, 0, 1]: mean .5, sample std sqrt(1/3)
    assert emitted["ghost"][0].advantages == pytest.approx([-a, a, -a, a], abs=1e-4)
    stats = worker.stats()
    assert stats["emit_recovered_present"] == 1 and stats["emit_recovered_missing"] == 1
    assert stats["emitted"] == 1


def test_partitions_move_between_two_workers_with_their_open_groups(
    tmp_path: Path, kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    """A second worker joins mid-stream, then the first stops: each move of a partition carries
    its half-filled groups (restored from the changelog), and every group comes out complete,
    once. A sample lost in a rebalance would leave its group to time out partial (on rl.stale)."""
    n, groups = 4, 48
    scored_topic = topics_config.name("scored")
    rng = random.Random(11)
    samples = [
        scored(f"m{i}", j, float(j == i % n), low=2) for i in range(groups) for j in range(n)
    ]
    rng.shuffle(samples)
    produce(kafka_config, topics_config.name("policy"), [PolicyVersion(version=2, path="/c/2")])
    one, two = (Worker(tmp_path / name, kafka_config, topics_config) for name in ("one", "two"))
    for w in (one, two):
        w.tmp.mkdir()
        w.configure(n=n, group_timeout_s=120, partial_policy="drop", batch_size=8)
    paced = threading.Event()

    def feed() -> None:
        for start in range(0, len(samples), 6):
            produce(kafka_config, scored_topic, list(samples[start : start + 6]))
            time.sleep(0.2)
            if start >= len(samples) // 3:
                paced.set()

    feeder = threading.Thread(target=feed, daemon=True)
    try:
        one.start()
        feeder.start()
        assert paced.wait(60)
        two.start()  # joins: the group rebalances and some partitions move to it
        time.sleep(8)
        one.kill(signal.SIGTERM)  # leaves: its partitions move to the second
        assert one.proc is None
        feeder.join(timeout=120)
        records = read_all(
            kafka_config,
            topics_config.name("replay"),
            until=lambda r: len(r) >= groups,
            timeout=120,
        )
        time.sleep(3)
        records = read_all(
            kafka_config, topics_config.name("replay"), until=lambda r: False, timeout=3
        )
        stale = read_all(
            kafka_config, topics_config.name("stale"), until=lambda r: False, timeout=3
        )
        emitted = groups_of(records)  # fails on a group emitted twice
        assert sorted(emitted) == sorted({s.uid for s in samples}), two.log_tail()
        assert not stale, f"dropped: {[r.key for r in stale]}"
        for group, _ in emitted.values():
            assert sorted(s.sample_index for s in group.samples) == list(range(n))
        moved = two.stats()
        print(f"first worker: {one.stats()}\nsecond worker: {moved}")
        assert moved.get("emitted", 0) > 0, "the second worker never owned a partition"
    finally:
        one.kill()
        two.kill()
