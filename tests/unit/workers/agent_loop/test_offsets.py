"""Contiguous-prefix commits for out-of-order completion."""

from __future__ import annotations

import random

from workers.agent_loop.offsets import OffsetTracker


def test_only_the_contiguous_prefix_is_committable() -> None:
    t = OffsetTracker()
    for off in range(5, 10):
        t.start("p0", off)
    assert t.committable() == {"p0": 5}
    t.mark_committed({"p0": 5})
    t.finish("p0", 6)
    t.finish("p0", 8)
    assert t.committable() == {}  # 5 is still running: nothing new
    t.finish("p0", 5)
    assert t.committable() == {"p0": 7}
    t.mark_committed({"p0": 7})
    t.finish("p0", 7)
    assert t.committable() == {"p0": 9}
    t.finish("p0", 9)
    assert t.committable() == {"p0": 10}
    assert t.in_flight() == 0


def test_gaps_in_offsets_do_not_block() -> None:
    t = OffsetTracker()
    for off in (3, 7, 8):  # 4-6 were compacted away
        t.start("p", off)
    t.finish("p", 7)
    assert t.position("p") == 3
    t.finish("p", 3)
    assert t.position("p") == 8
    t.finish("p", 8)
    assert t.position("p") == 9


def test_partitions_are_independent_and_drop_forgets() -> None:
    t = OffsetTracker()
    t.start("a", 0)
    t.start("b", 100)
    t.finish("b", 100)
    assert t.committable() == {"a": 0, "b": 101}
    dropped = t.drop("a")
    assert dropped is not None and dropped.pending == {0}
    assert t.partitions() == ["b"]


def test_never_commits_past_an_unfinished_offset_under_random_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        t = OffsetTracker()
        offsets = list(range(rng.randint(1, 40)))
        for off in offsets:
            t.start("p", off)
        order = offsets[:]
        rng.shuffle(order)
        done: set[int] = set()
        for off in order:
            t.finish("p", off)
            done.add(off)
            position = t.position("p")
            assert position is not None
            assert all(o in done for o in range(position))  # everything before is finished
            assert position == len(offsets) or position not in done  # and it is maximal
