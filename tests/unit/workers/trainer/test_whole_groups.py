"""`WholeGroups`: whole groups only, released by prefix so positions pass no held record."""

from __future__ import annotations

from dataclasses import dataclass

from workers.trainer.whole_groups import WholeGroups


@dataclass
class Scored:
    uid: str
    sample_index: int
    group_size: int | None = 2


def feed(groups: WholeGroups, records: list[tuple[str, int]], now: float = 0.0) -> None:
    for offset, (uid, index) in enumerate(records):
        groups.add("p0", offset + 1, Scored(uid, index), now)


def uids(released: list[list[Scored]]) -> list[tuple[str, list[int]]]:
    return [(g[0].uid, [s.sample_index for s in g]) for g in released]


def test_interleaved_groups_come_out_whole_and_in_prefix_order() -> None:
    groups = WholeGroups()
    feed(groups, [("a", 0), ("b", 0), ("b", 1)])  # b is whole, but a's first record is older
    out = groups.take(now=1.0)
    assert out.groups == [] and out.positions == {}
    groups.add("p0", 4, Scored("a", 1), 1.0)
    out = groups.take(now=1.0)
    assert uids(out.groups) == [("a", [0, 1]), ("b", [0, 1])]
    assert out.positions == {"p0": 4} and groups.held == 0


def test_a_whole_prefix_is_released_before_an_open_group_behind_it() -> None:
    groups = WholeGroups()
    feed(groups, [("a", 0), ("a", 1), ("c", 0)])
    out = groups.take(now=0.0)
    assert uids(out.groups) == [("a", [0, 1])]
    assert out.positions == {"p0": 2}  # stops before c's record at offset 2
    assert groups.held == 1


def test_a_group_whose_records_straddle_an_open_one_waits_for_it() -> None:
    groups = WholeGroups()
    feed(groups, [("a", 0), ("c", 0), ("a", 1)])  # a is whole, c (inside a's span) is not
    assert groups.take(now=0.0).groups == []
    groups.add("p0", 4, Scored("c", 1), 0.0)
    assert uids(groups.take(now=0.0).groups) == [("a", [0, 1]), ("c", [0, 1])]


def test_a_group_that_never_completes_is_released_partial_after_the_timeout() -> None:
    groups = WholeGroups(group_timeout_s=10.0)
    feed(groups, [("a", 0), ("b", 0), ("b", 1)], now=0.0)
    assert groups.take(now=9.9).groups == []
    out = groups.take(now=10.0)
    assert uids(out.groups) == [("a", [0]), ("b", [0, 1])]
    assert groups.partial_groups == 1 and out.positions == {"p0": 3}


def test_a_redelivered_sample_is_released_once_and_counted() -> None:
    groups = WholeGroups()
    feed(groups, [("a", 0), ("a", 0), ("a", 1)])
    out = groups.take(now=0.0)
    assert uids(out.groups) == [("a", [0, 1])]
    assert groups.duplicates == 1 and out.positions == {"p0": 3}


def test_partitions_are_independent_and_a_trajectory_without_group_size_is_alone() -> None:
    groups = WholeGroups()
    groups.add("p0", 8, Scored("a", 0), 0.0)
    groups.add("p1", 5, Scored("x", 0, group_size=None), 0.0)
    out = groups.take(now=0.0)
    assert uids(out.groups) == [("x", [0])]
    assert out.positions == {"p1": 5}
