"""`OutputLedger`'s partition choice: a stage places each output where a producer with the
default partitioner would, so it knows the partition (and its end offset) before producing.

The end offsets, `start` (partition counts from the producer's metadata) and the look-back
`scan` read the broker and are left to the integration tests
(tests/integration/test_reward_worker.py::test_outputs_of_an_uncommitted_batch_are_not_emitted_again,
test_replay_worker.py::test_restart_resolves_emitting_markers_left_by_a_crash, and both
stages' SIGKILL tests).
"""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner

from workers.kafka.config import KafkaConfig
from workers.kafka.ledger import OutputLedger, partition_for

# Apache Kafka's UtilsTest.testMurmur2: key → the Java client's murmur2, a signed int.
JAVA_MURMUR2 = {
    "21": -973932308,
    "foobar": -790332482,
    "a-little-bit-long-string": -985981536,
    "a-little-bit-longer-string": -1486304829,
    "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    "abc": 479470107,
}


def java_partition(key: str, partitions: int) -> int:
    """The Java producer's `Utils.toPositive(murmur2(key)) % partitions`."""
    return (JAVA_MURMUR2[key] & 0x7FFFFFFF) % partitions


@pytest.mark.parametrize("key", sorted(JAVA_MURMUR2))
@pytest.mark.parametrize("partitions", [1, 3, 12, 50, 1000])
def test_partition_is_the_java_clients_choice(key: str, partitions: int) -> None:
    assert partition_for(key, partitions) == java_partition(key, partitions)


def test_partition_of_known_keys() -> None:
    # The numbers written out: "foobar" hashes to -790332482 (its top bit is dropped, not
    # its sign flipped: abs() would give 32 here); "abc" hashes to a positive int.
    assert partition_for("foobar", 50) == 16
    assert partition_for("21", 12) == 0
    assert partition_for("abc", 7) == 479470107 % 7 == 4
    assert partition_for("a-little-bit-long-string", 10) == 2


KEYS = ["", "u/0", "uid-12345", "gsm8k/train/7#3", "é", "ключ", "🦜", "x" * 300]


@pytest.mark.parametrize("partitions", [1, 2, 4, 7, 16, 200])
def test_partition_matches_aiokafkas_default_partitioner(partitions: int) -> None:
    every = list(range(partitions))
    chosen = [DefaultPartitioner()(k.encode("utf-8"), every, every) for k in KEYS]
    assert [partition_for(k, partitions) for k in KEYS] == chosen


async def test_each_topic_uses_its_own_partition_count() -> None:
    ledger = OutputLedger(KafkaConfig(), ["out.a", "out.b"], client_id="test-ledger")
    assert ledger.topics == ["out.a", "out.b"]
    assert ledger.partitions == {}  # learnt in `start`
    ledger.partitions = {"out.a": 3, "out.b": 50}
    assert ledger.partition_for("out.a", "foobar") == java_partition("foobar", 3) == 0
    assert ledger.partition_for("out.b", "foobar") == 16
    await ledger.stop()


async def test_a_topic_whose_partitions_are_unknown_has_no_partition() -> None:
    ledger = OutputLedger(KafkaConfig(), ["out.a"], client_id="test-ledger")
    with pytest.raises(KeyError):
        ledger.partition_for("out.a", "foobar")  # before `start`: never a guess
    ledger.partitions = {"out.a": 4}
    with pytest.raises(KeyError):
        ledger.partition_for("out.other", "foobar")
    await ledger.stop()
