"""Micro-batches of an update: by sample count, or by a token budget (verl's
`ppo_max_token_len_per_gpu`), and a mini-batch's samples shared out over the sharded trainer's
ranks.

- `trainer.max_tokens_per_micro_batch` unset: consecutive slices of `micro_batch_size` samples.
- set: first-fit-decreasing over the samples' token counts (prompt + response, what a packed
  forward computes): longest first, each into the first micro-batch it still fits, so the
  micro-batches come out full and few; a sample longer than the budget forms one alone.
  `micro_batch_size` is then not used.
- `balanced_shares(lengths, world)`: the longest-processing-time rule (longest first, each to
  the rank with the fewest tokens so far), so no rank's share is much longer than another's.

Which micro-batch a sample lands in changes no update: the loss of each is normalised by the
counts of the whole update (`workers.trainer.step.UpdateCounts`), so the micro-batches' losses
add up to the update's loss for every `loss_agg_mode`. Pure logic on lists of ints, plus
`micro_batches` which cuts a `TrajectoryBatch` by them.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.trainer.batching import TrajectoryBatch

__all__ = [
    "balanced_shares",
    "first_fit_decreasing",
    "micro_batch_indices",
    "micro_batches",
    "sample_tokens",
]


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `budget` tokens (module docstring); each bin's
    indices ascending, bins in the order they were opened (the longest sample's first)."""
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, not {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def balanced_shares(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of `lengths` shared over `world` ranks, near-equal in tokens (module docstring);
    each share ascending. A rank may get nothing when there are fewer samples than ranks."""
    if world < 1:
        raise ValueError(f"world must be >= 1, not {world}")
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        rank = min(range(world), key=lambda r: (load[r], len(shares[r]), r))
        shares[rank].append(i)
        load[rank] += lengths[i]
    return [sorted(s) for s in shares]


def sample_tokens(batch: TrajectoryBatch) -> list[int]:
    """Each sample's real tokens (prompt + response): what a packed forward computes for it."""
    return [int(x) for x in batch["attention_mask"].sum(dim=1).tolist()]


def micro_batch_indices(
    batch: TrajectoryBatch, micro_batch_size: int, max_tokens: int | None
) -> list[list[int]]:
    """The samples of each micro-batch of `batch` (module docstring)."""
    if max_tokens is None:
        count = len(batch)
        return [
            list(range(lo, min(lo + micro_batch_size, count)))
            for lo in range(0, count, micro_batch_size)
        ]
    return first_fit_decreasing(sample_tokens(batch), max_tokens)


def micro_batches(
    batch: TrajectoryBatch, micro_batch_size: int, max_tokens: int | None
) -> list[TrajectoryBatch]:
    """`batch` cut into micro-batches (module docstring)."""
    if max_tokens is None:
        return batch.split(micro_batch_size)
    return [batch.take(b) for b in micro_batch_indices(batch, micro_batch_size, max_tokens)]
