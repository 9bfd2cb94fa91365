"""`ChangelogTable`'s in-memory side: what a changelog's records fold into, and dropping the
partitions another process now owns.

The records are given as plain data and folded the way `restore` folds what it reads
(`apply` below, the table's one private seam); reading the changelog topic and `write`
(which produces to it) need a broker: tests/integration/test_kafka_security.py restores a
table through a real one, and the reward and replay worker tests move partitions between
two workers.
"""

from __future__ import annotations

import asyncio

from workers.kafka.changelog import ChangelogTable
from workers.kafka.config import KafkaConfig

Record = tuple[bytes, bytes | None, int]  # key, value (None: tombstone), source partition


def table() -> ChangelogTable:
    return ChangelogTable(KafkaConfig(), "changelog", client_id="test")


def apply(table: ChangelogTable, records: list[Record]) -> None:
    """What `restore` does with each record it reads, in order."""
    for key, value, partition in records:
        table._apply(key, value, partition)


def test_replaying_a_changelog_keeps_the_last_value_of_each_key() -> None:
    t = table()
    apply(t, [(b"a", b"1", 0), (b"b", b"1", 1), (b"a", b"2", 0), (b"c", b"1", 1)])
    assert t.get(b"a") == b"2"
    assert sorted(t.items()) == [(b"a", b"2", 0), (b"b", b"1", 1), (b"c", b"1", 1)]


def test_a_tombstone_deletes_its_key_and_a_later_write_brings_it_back() -> None:
    t = table()
    apply(t, [(b"a", b"1", 0), (b"b", b"1", 0), (b"a", None, 0)])
    assert t.get(b"a") is None
    assert t.items() == [(b"b", b"1", 0)]
    apply(t, [(b"a", b"3", 0), (b"gone", None, 0)])  # a tombstone of an unknown key is a no-op
    assert sorted(t.items()) == [(b"a", b"3", 0), (b"b", b"1", 0)]


def test_put_sets_an_entry_in_memory_with_its_partition() -> None:
    t = table()
    t.put(b"k", b"v", 3)
    t.put(b"k", b"w", 3)
    assert t.get(b"k") == b"w"
    assert t.items() == [(b"k", b"w", 3)]


def test_dropping_partitions_forgets_only_their_entries() -> None:
    t = table()
    apply(t, [(b"a", b"1", 0), (b"b", b"1", 1), (b"c", b"1", 2), (b"d", b"1", 1)])
    t.partitions = {0, 1, 2}
    t.drop([1, 2])
    assert t.items() == [(b"a", b"1", 0)]
    assert t.get(b"b") is None and t.get(b"c") is None
    assert t.partitions == {0}
    t.drop([5])  # not held: nothing happens
    assert t.items() == [(b"a", b"1", 0)] and t.partitions == {0}


def test_items_is_a_copy() -> None:
    t = table()
    t.put(b"a", b"1", 0)
    items = t.items()
    t.put(b"b", b"2", 0)
    items.clear()
    assert sorted(t.items()) == [(b"a", b"1", 0), (b"b", b"2", 0)]


async def test_restore_reads_only_partitions_it_does_not_hold() -> None:
    t = table()
    t.put(b"a", b"1", 0)
    t.partitions = {0, 1}
    # Nothing to read: it returns without making a client (there is no broker here).
    assert await asyncio.wait_for(t.restore([1, 0, 1]), 1) == 0
    assert t.items() == [(b"a", b"1", 0)] and t.partitions == {0, 1}
