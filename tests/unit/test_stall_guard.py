"""StallGuard's decision: re-seek only a source partition whose committed offset sits
below its end, unchanged for stall_s (the faust-streaming drop it works around)."""

from __future__ import annotations

from types import SimpleNamespace

from faust.types import TP

from workers.kafka.faust_app import StallGuard


class Consumer:
    def __init__(self) -> None:
        self.ends: dict[TP, int] = {}
        self._committed_offset: dict[TP, int | None] = {}

    def assignment(self) -> set[TP]:
        return set(self.ends)

    def highwater(self, tp: TP) -> int:
        return self.ends[tp]


def test_only_partitions_stuck_behind_their_end_for_stall_s_are_reported() -> None:
    consumer = Consumer()
    src, idle, other = TP("turns", 0), TP("turns", 1), TP("turns-changelog", 0)
    consumer.ends = {src: 544, idle: 525, other: 900}
    consumer._committed_offset = {src: 215, idle: 524, other: 10}
    guard = StallGuard(SimpleNamespace(consumer=consumer), {"turns"}, stall_s=30)
    assert guard.stuck(0.0) == {}  # first look: remembers the offsets
    assert guard.stuck(29.0) == {}  # not long enough
    assert guard.stuck(30.0) == {src: (215, 544)}  # idle is at its end; changelogs ignored
    consumer._committed_offset[src] = 216  # progress resets the clock
    assert guard.stuck(40.0) == {}
    assert guard.stuck(69.0) == {}
    assert guard.stuck(70.0) == {src: (216, 544)}


def test_a_partition_never_committed_counts_from_offset_zero() -> None:
    consumer = Consumer()
    tp = TP("turns", 0)
    consumer.ends, consumer._committed_offset = {tp: 5}, {tp: None}
    guard = StallGuard(SimpleNamespace(consumer=consumer), {"turns"}, stall_s=10)
    guard.stuck(0.0)
    assert guard.stuck(10.0) == {tp: (None, 5)}
    consumer.ends[tp] = 0
    assert guard.stuck(20.0) == {}
