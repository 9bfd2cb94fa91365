"""One optimiser step of an FSDP2-sharded policy, on every rank, equal to the one-process step.

Every rank holds the whole collated batch (the same padding everywhere) and trains its share
of each mini-batch (`workers.trainer.step.mini_batches`, whole groups):

- by count (`max_tokens_per_micro_batch` unset): rank r takes the r-th of `world` contiguous,
  near-equal slices of samples, in micro-batches of `micro_batch_size`;
- by token budget: the samples are shared out by tokens (`micro_batches.balanced_shares`, the
  longest first to the least loaded rank), so no rank's share is much longer than another's,
  and each rank packs its share into micro-batches first-fit-decreasing. Every rank computes
  every rank's share (all hold the batch), so this needs no communication.

The loss of a share is normalised by the *mini-batch's* token and sequence counts, not the
share's, and scaled by `world`, because FSDP2's reduce-scatter averages gradients over ranks:
the average of `world × share gradient` is the sum of the shares' gradients, which is the
gradient of the one-process loss. Clipping uses the global norm (the gradients are DTensors,
`clip_grad_norm_` reduces over the mesh), so the update equals the one-process update up to
float summation order (`rollout bench fsdp` measures it).

Invariants:
- Every rank runs the same number of forwards and backwards per update (FSDP2 all-gathers per
  layer per forward): a rank whose share has fewer micro-batches, or none, runs the missing
  ones on one sample (the shortest) with weight 0. Its parameters still receive (zero)
  gradients in step.
- The step's metrics are those of the whole batch: the micro-batch parts of every rank are
  gathered as rows over one fixed key set (`loss.METRIC_KEYS` and `router_replay.COUNT_KEYS`,
  with a presence flag per key, so a micro-batch without routing beside one with lines up);
  a weight-0 micro-batch sends a row of 0 tokens, which is dropped (`summarize` would ignore it).
- The step's own collectives (the loss, the metric rows) carry CPU tensors on `group`, the
  trainer's gloo control group, never on the default group: that is NCCL on GPUs, which takes
  no CPU tensor. Without a `group` they go to the default group as tensors on the policy's
  device (CUDA tensors for NCCL). FSDP2's collectives (device tensors, on the mesh) are its own.
- No-grad forwards (proximal and reference logprobs) run on the whole batch on every rank.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from workers.trainer.batching import TrajectoryBatch
from workers.trainer.config import TrainerConfig
from workers.trainer.exceptions import TrainerError
from workers.trainer.loss import METRIC_KEYS
from workers.trainer.micro_batches import balanced_shares, first_fit_decreasing, sample_tokens
from workers.trainer.packing import layout
from workers.trainer.router_replay import COUNT_KEYS
from workers.trainer.step import UpdateCounts, micro_loss, train_step, update_result

__all__ = ["KEYS", "rank_micro_batches", "shard_bounds", "sharded_train_step"]

#: The metric keys a micro-batch's row is gathered by (module docstring).
KEYS = tuple(sorted({*METRIC_KEYS, *COUNT_KEYS}))


def shard_bounds(count: int, rank: int, world: int) -> tuple[int, int]:
    """The rank's contiguous slice [lo, hi) of `count` items (sizes differ by at most one)."""
    return (rank * count) // world, ((rank + 1) * count) // world


def rank_micro_batches(
    mb: TrajectoryBatch, config: TrainerConfig, rank: int, world: int
) -> list[tuple[TrajectoryBatch, float]]:
    """This rank's micro-batches of the mini-batch `mb`, each with its weight (1, or 0 for a
    stand-in that only keeps the ranks' forward counts equal); see the module docstring."""
    budget = config.max_tokens_per_micro_batch
    if budget is None:
        lo, hi = shard_bounds(len(mb), rank, world)
        largest = -(-len(mb) // world)
        count = max(1, -(-largest // config.micro_batch_size))
        size = config.micro_batch_size
        micros = [(m, 1.0) for m in mb.select(lo, hi).split(size)] if hi > lo else []
        return micros + [(mb.select(0, 1), 0.0)] * (count - len(micros))
    lengths = sample_tokens(mb)
    shares = balanced_shares(lengths, world)
    packs = [first_fit_decreasing([lengths[i] for i in s], budget) for s in shares]
    count = max(1, *(len(p) for p in packs))
    mine = [(mb.take([shares[rank][i] for i in b]), 1.0) for b in packs[rank]]
    shortest = min(range(len(mb)), key=lambda i: (lengths[i], i))
    return mine + [(mb.take([shortest]), 0.0)] * (count - len(mine))


def _row(metrics: dict[str, float], weight: float) -> list[float]:
    """Values then presence flags over `KEYS`; a weight-0 micro-batch's row has 0 tokens."""
    unknown = set(metrics) - set(KEYS)
    if unknown:
        raise TrainerError(f"metrics the sharded step does not gather: {sorted(unknown)}")
    if not weight:
        return [0.0] * (2 * len(KEYS))
    return [metrics.get(k, 0.0) for k in KEYS] + [float(k in metrics) for k in KEYS]


def _update(
    model: Any,
    optimizer: torch.optim.Optimizer,
    mb: TrajectoryBatch,
    config: TrainerConfig,
    *,
    rank: int,
    world: int,
    group: Any = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    optimizer.zero_grad(set_to_none=True)
    counts = UpdateCounts.of(mb, config)  # the mini-batch's, global: not the share's
    rows: list[list[float]] = []
    device = mb["input_ids"].device
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    micros = [
        (micro, weight, layout(micro, packed=config.packed, trained_only=True))
        for micro, weight in rank_micro_batches(mb, config, rank, world)
    ]  # every layout first: none waits on a forward in flight
    for micro, weight, view in micros:
        out = micro_loss(model, micro, config, counts, view)
        (out.loss * (world * weight)).backward()
        rows.append(_row(out.metrics, weight))
        local_loss += out.loss.detach() * weight
    # The global norm over every shard; max_norm inf when unclipped (the factor is then 1).
    norm = torch.nn.utils.clip_grad_norm_(
        list(model.parameters()), config.max_grad_norm or float("inf")
    )
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    grad_norm = float(norm)
    if math.isfinite(grad_norm):  # the same on every rank: the norm is global
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # The control group is gloo (CPU tensors); the default group takes the policy's device.
    on = torch.device("cpu") if group is not None else device
    local_loss = local_loss.to(on)
    dist.all_reduce(local_loss, group=group)
    parts = _gather_parts(rows, world, group, on)
    return update_result(parts, loss=float(local_loss), grad_norm=grad_norm)


def _gather_parts(
    rows: list[list[float]], world: int, group: Any, device: torch.device
) -> list[dict[str, float]]:
    """Every rank's micro-batch metrics (equal row counts by construction), real rows only,
    each with the keys its micro-batch had."""
    local = torch.tensor(rows, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    n, tokens = len(KEYS), KEYS.index("tokens")
    return [
        {k: v for k, v, present in zip(KEYS, row[:n], row[n:], strict=True) if present}
        for part in gathered
        for row in part.tolist()
        if row[tokens] > 0
    ]


def sharded_train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: TrajectoryBatch,
    config: TrainerConfig,
    *,
    rank: int,
    world: int,
    group: Any = None,
    ref_model: Any | None = None,
) -> dict[str, Any]:
    """`workers.trainer.step.train_step` for rank `rank` of `world`; same metrics, same update.

    Every rank must call it with the same `batch` (see the module docstring); `group` is a
    gloo group of every rank (the trainer's control group) for the step's CPU collectives
    (None: the default group, with tensors on the policy's device)."""
    update = functools.partial(_update, rank=rank, world=world, group=group)
    return train_step(model, optimizer, batch, config, ref_model=ref_model, update=update)
