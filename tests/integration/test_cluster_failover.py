"""A broker lost mid-run on a real three-broker cluster (replication 3, min.insync.replicas 2):
the pipeline's producer and its stage loop keep their counts exact across a SIGKILL of the
leader of their partitions, and a consumer group survives its coordinator's broker dying.

In the manner of Kafka's own system tests (a verifiable producer and consumer under leader
kills): a known input, a broker SIGKILLed while data moves, restarted later, then every record
accounted for. `make test-long` runs them (marker `long`); the session starts the cluster once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pipeline.broker.cluster import ClusterState, signal_node, start_node
from pipeline.broker.leaders import coordinator_of, partition_leaders
from tests.conftest import REPO
from workers.kafka.admin import TopicLayout, ensure_topics, group_offsets
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.config import KafkaConfig

pytestmark = [pytest.mark.kafka, pytest.mark.long]

PARTITIONS = 4


def _topic(kafka: KafkaConfig, name: str) -> str:
    configs = {"min.insync.replicas": "2"}
    ensure_topics(kafka, [TopicLayout(name, PARTITIONS, 3, configs)])
    return name


def _busiest(cluster: ClusterState, topics: list[str], exclude: set[int] = frozenset()) -> int:
    """The broker leading the most partitions of `topics` (but those of `exclude`)."""
    led = partition_leaders(cluster.kafka(), topics)
    counts = {n: sum(len(p) for p in led.get(n, {}).values()) for n in cluster.nodes}
    return max((n for n in cluster.nodes if n not in exclude), key=lambda n: counts[n])


def _read_all(kafka: KafkaConfig, topic: str) -> list[Any]:
    from kafka import TopicPartition

    consumer = make_consumer(kafka, group_id=None, name="audit")
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records: list[Any] = []
        deadline = time.monotonic() + 60
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} to its end"
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


@contextmanager
def _killed(cluster: ClusterState, node: int, down_s: float) -> Iterator[None]:
    """SIGKILL `node` on entry; start it again `down_s` later, in the background."""
    signal_node(cluster, node, signal.SIGKILL)
    restarted = threading.Timer(down_s, lambda: start_node(cluster, node, timeout_s=180))
    restarted.start()
    try:
        yield
    finally:
        restarted.join()


def _feed(kafka: KafkaConfig, topic: str, count: int, rate: float) -> Callable[[], int]:
    """Produce `count` keyed records at `rate` a second in the background; the join returns
    how many were acknowledged (every future waited on)."""
    errors: list[BaseException] = []
    done: list[int] = []

    def run() -> None:
        producer = make_producer(kafka, name="feed")
        futures = []
        started = time.monotonic()
        for i in range(count):
            futures.append(producer.send(topic, key=f"k{i % 13}", value=str(i).encode()))
            time.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
        for future in futures:
            try:
                future.get(timeout=200)
            except Exception as exc:  # the assertion below names it
                errors.append(exc)
        producer.close()
        done.append(len(futures) - len(errors))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> int:
        thread.join(timeout=300)
        assert not errors, f"{len(errors)} records not acknowledged, first: {errors[0]!r}"
        return done[0]

    return join


def test_a_producer_loses_nothing_and_writes_nothing_twice_across_its_leaders_sigkill(
    whole_cluster: ClusterState, unique: Callable[[str], str]
) -> None:
    kafka = whole_cluster.kafka()
    topic = _topic(kafka, unique("failover-produce"))
    count = 3000
    join = _feed(kafka, topic, count, rate=250.0)
    time.sleep(3.0)  # records are flowing to every partition's leader
    victim = _busiest(whole_cluster, [topic])
    with _killed(whole_cluster, victim, down_s=8.0):
        assert join() == count  # every future acknowledged: none failed during the election
    values = [int(r.value) for r in _read_all(kafka, topic)]
    counts = Counter(values)
    assert sorted(counts) == list(range(count)), "records lost"
    assert [v for v, c in counts.items() if c > 1] == [], "records written twice"
    by_key: dict[bytes, list[int]] = {}
    for record in sorted(_read_all(kafka, topic), key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(record.key, []).append(int(record.value))
    assert all(vs == sorted(vs) for vs in by_key.values()), "a key's records out of order"


class _Stage:
    """`tests.integration.cluster_stage` as a subprocess, and a watch of its commits."""

    def __init__(self, cluster: ClusterState, source: str, output: str, group: str) -> None:
        self.kafka, self.source, self.output, self.group = cluster.kafka(), source, output, group
        argv = [sys.executable, "-m", "tests.integration.cluster_stage"]
        self.proc = subprocess.Popen(
            [*argv, cluster.bootstrap, source, output, group],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        # (committed input offsets, output end offsets read right after) over time
        self.watch: list[tuple[dict[int, int], dict[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from kafka import TopicPartition

        consumer = make_consumer(self.kafka, group_id=None, name="watch")
        tps = [TopicPartition(self.output, p) for p in range(PARTITIONS)]
        while not self._stop.wait(0.3):
            try:
                committed = {
                    tp.partition: at.offset
                    for tp, at in group_offsets(self.kafka, self.group, wait_s=5).items()
                }
                ends = {tp.partition: end for tp, end in consumer.end_offsets(tps).items()}
            except Exception:  # the cluster is electing: the next look will do
                continue
            self.watch.append((committed, ends))
        consumer.close()

    def committed(self) -> int:
        return sum(self.watch[-1][0].values()) if self.watch else 0

    def wait_committed(self, total: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.committed() < total:
            assert self.proc.poll() is None, f"the stage exited:\n{self.proc.stderr.read()}"
            assert time.monotonic() < deadline, f"committed {self.committed()} of {total}"
            time.sleep(0.3)

    def stop(self) -> int:
        assert self.proc.poll() is None, f"the stage exited:\n{self.proc.stderr.read()}"
        self._stop.set()
        self._thread.join()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        """After a failed test: never leave the stage running."""
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def outputs(self) -> Counter[str]:
        return Counter(r.value.decode() for r in _read_all(self.kafka, self.output))

    def check_offsets_behind_outputs(self) -> None:
        """No offset was committed ahead of its output's acknowledgement: an input below a
        committed offset has its output below the output's end offsets read right after
        (an output the in-sync replicas acknowledged before the commit is there by then)."""
        where: dict[str, tuple[int, int]] = {}  # input "p:o" → its first output (partition, offset)
        for record in _read_all(self.kafka, self.output):
            at = (record.partition, record.offset)
            where[record.value.decode()] = min(where.get(record.value.decode(), at), at)
        assert self.watch, "the commits were never observed"
        checked: dict[int, int] = {}
        for committed, ends in self.watch:
            for partition, upto in committed.items():
                for offset in range(checked.get(partition, 0), upto):
                    key = f"{partition}:{offset}"
                    assert key in where, f"input {key} committed, its output never written"
                    q, off = where[key]
                    assert off < ends[q], f"input {key} committed before its output was acked"
                checked[partition] = max(checked.get(partition, 0), upto)


@pytest.fixture
def stages() -> Iterator[list[_Stage]]:
    """The stages a test starts, killed at its end if it left them running."""
    started: list[_Stage] = []
    yield started
    for stage in started:
        stage.kill()


def test_a_stage_loop_keeps_its_counts_exact_across_its_leaders_sigkill(
    whole_cluster: ClusterState, unique: Callable[[str], str], stages: list[_Stage]
) -> None:
    kafka = whole_cluster.kafka()
    source = _topic(kafka, unique("failover-in"))
    output = _topic(kafka, unique("failover-out"))
    group = unique("failover-stage")
    count = 3000
    stage = _Stage(whole_cluster, source, output, group)
    stages.append(stage)
    join = _feed(kafka, source, count, rate=200.0)
    time.sleep(4.0)
    coordinator = coordinator_of(kafka, group)
    # The leader of the most of its partitions, not its group's coordinator (the next test).
    victim = _busiest(whole_cluster, [source, output], exclude={coordinator})
    with _killed(whole_cluster, victim, down_s=10.0):
        assert join() == count
        stage.wait_committed(count, timeout_s=120)
    assert stage.stop() == 0
    outputs = stage.outputs()
    assert sum(outputs.values()) == count and len(outputs) == count, (
        f"{count - len(outputs)} inputs without an output, "
        f"{sum(c - 1 for c in outputs.values())} outputs twice"
    )
    stage.check_offsets_behind_outputs()


def test_a_consumer_group_survives_its_coordinators_broker_dying(
    whole_cluster: ClusterState, unique: Callable[[str], str], stages: list[_Stage]
) -> None:
    kafka = whole_cluster.kafka()
    source = _topic(kafka, unique("coord-in"))
    output = _topic(kafka, unique("coord-out"))
    group = unique("coord-stage")
    count = 2500
    stage = _Stage(whole_cluster, source, output, group)
    stages.append(stage)
    join = _feed(kafka, source, count, rate=200.0)
    stage.wait_committed(400, timeout_s=60)
    coordinator = coordinator_of(kafka, group)
    with _killed(whole_cluster, coordinator, down_s=12.0):
        before = stage.committed()
        deadline = time.monotonic() + 30
        while coordinator_of(kafka, group) == coordinator:  # until the broker is fenced
            assert time.monotonic() < deadline, "the coordinator did not move"
            time.sleep(0.5)
        stage.wait_committed(before + 300, timeout_s=60)  # commits go on, to the new one
        assert join() == count
        stage.wait_committed(count, timeout_s=120)
    assert stage.stop() == 0
    outputs = stage.outputs()
    assert len(outputs) == count, f"{count - len(outputs)} inputs without an output"
    assert sum(outputs.values()) == count, f"{sum(outputs.values()) - count} outputs twice"


def test_new_clients_connect_while_a_broker_is_frozen(
    whole_cluster: ClusterState, unique: Callable[[str], str]
) -> None:
    # A SIGSTOPped broker accepts TCP connections and never answers: a new client whose
    # bootstrap tries it must still reach the other two. kafka-python picks the bootstrap
    # server itself: without `_connect`'s one-by-one fallback one of 24 new clients (12
    # turns) gave up after bootstrap_timeout_ms (5 s), before asking the live brokers.
    turns = 4
    from workers.kafka.clients import make_admin

    kafka = whole_cluster.kafka()
    topic = _topic(kafka, unique("frozen"))
    signal_node(whole_cluster, 1, signal.SIGSTOP)
    try:
        for turn in range(turns):
            started = time.monotonic()
            make_admin(kafka).close()
            producer = make_producer(kafka, name="frozen")
            producer.send(topic, key=b"k", value=str(turn).encode()).get(timeout=120)
            producer.close()
            assert time.monotonic() - started < 90
    finally:
        signal_node(whole_cluster, 1, signal.SIGCONT)
    assert sorted(int(r.value) for r in _read_all(kafka, topic)) == list(range(turns))
