"""Micro-batches by a token budget (first-fit-decreasing) and shares of ranks by tokens."""

from __future__ import annotations

import random

import pytest

from workers.trainer.micro_batches import balanced_shares, first_fit_decreasing


def test_first_fit_decreasing_fills_bins_within_the_budget() -> None:
    lengths = [70, 20, 50, 30, 10, 40, 60, 90]
    bins = first_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    # 370 tokens: four bins of 100 is the least possible, and FFD finds it here
    assert len(bins) == 4
    # longest first, each into the first bin with room: 90+10, 70+30, 60+40, 50+20
    assert bins == [[4, 7], [0, 3], [5, 6], [1, 2]]


def test_a_sample_longer_than_the_budget_trains_alone() -> None:
    bins = first_fit_decreasing([300, 20, 30], 100)
    assert [0] in bins and sorted(i for b in bins for i in b) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(5))
def test_random_lengths_never_exceed_the_budget_and_are_few(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(20, 1200) for _ in range(128)]
    bins = first_fit_decreasing(lengths, 4096)
    assert sorted(i for b in bins for i in b) == list(range(128))
    assert all(sum(lengths[i] for i in b) <= 4096 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 4096) + 1  # FFD: within one bin of the bound here


def test_shares_of_ranks_are_near_equal_in_tokens() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(20, 1200) for _ in range(64)]
    shares = balanced_shares(lengths, 4)
    assert sorted(i for s in shares for i in s) == list(range(64))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)
    by_count = [sum(lengths[r * 16 : (r + 1) * 16]) for r in range(4)]  # contiguous slices
    assert max(loads) - min(loads) < max(by_count) - min(by_count)


def test_fewer_samples_than_ranks_leave_a_rank_empty() -> None:
    assert balanced_shares([5], 2) == [[0], []]
    with pytest.raises(ValueError):
        first_fit_decreasing([1], 0)
