"""The chaos suite's accounting: every sample lands in exactly one class."""

from __future__ import annotations

from pipeline.harness.chaos.accounting import account, expected_ids


def test_a_clean_run_accounts_for_everything_once() -> None:
    expected = expected_ids(["a", "b", "c"], 2)
    result = account(expected, ["a/0", "a/1", "b/0"], ["b/1"], ["c"])
    assert (result.trained, result.stale, result.dead_letter, result.lost) == (3, 1, 2, 0)
    assert result.ok and result.accounted == 6
    assert result.table().endswith("lost=0 duplicated=0")


def test_lost_duplicated_and_unexpected_samples_fail_the_run() -> None:
    expected = expected_ids(["a", "b"], 2)
    result = account(expected, ["a/0", "a/0", "b/0", "zz/0"], ["b/0"], [])
    assert result.lost == 2 and sorted(result.lost_ids) == ["a/1", "b/1"]
    assert result.trained_twice == ["a/0"] and result.stale_and_trained == ["b/0"]
    assert result.duplicated == 2 and result.unexpected == ["zz/0"]
    assert not result.ok
    assert result.table().endswith("lost=2 duplicated=2")


def test_a_dead_letter_keyed_by_trajectory_names_one_sample_only() -> None:
    result = account(expected_ids(["u"], 3), [], [], ["u/1"])
    assert result.dead_letter == 1 and result.lost == 2
