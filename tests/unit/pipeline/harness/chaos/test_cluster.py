"""The stall figure of the chaos suite's broker faults (pure)."""

from __future__ import annotations

from pipeline.harness.chaos.cluster import longest_stall, longest_stalls


def test_the_longest_gap_in_progress_that_overlaps_the_fault_is_its_stall() -> None:
    grew = [1.0, 2.0, 3.0, 11.0, 12.0, 13.0, 30.0]
    # The fault ran 4..6: the gap 3..11 overlaps it; 13..30 starts after the window.
    assert longest_stall(grew, start=4.0, end=6.0, until=31.0) == 8.0
    # A window reaching 14 also takes the gap 13..30.
    assert longest_stall(grew, start=4.0, end=14.0, until=31.0) == 17.0
    # Progress at every sample: the stall is the sampling interval's.
    steady = [i * 0.25 for i in range(100)]
    assert longest_stall(steady, start=5.0, end=10.0, until=25.0) == 0.2


def test_a_stage_that_never_progressed_again_is_stalled_until_the_last_sample() -> None:
    assert longest_stall([1.0, 2.0], start=4.0, end=6.0, until=40.0) == 38.0
    assert longest_stall([], start=4.0, end=6.0, until=40.0) == 36.0


def test_a_stage_that_finished_its_work_before_the_fault_is_not_stalled_by_it() -> None:
    # Its last growth at 2, then growth again later: only closed gaps that overlap count.
    assert longest_stall([1.0, 2.0, 50.0], start=10.0, end=12.0, until=60.0) == 48.0
    assert longest_stalls([{"stall_s": {"reward": 3.0}}, {"stall_s": {"reward": 5.0}}, {}]) == {
        "reward": 5.0
    }
