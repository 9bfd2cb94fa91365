"""One optimiser step of an FSDP2-sharded policy, on every rank, equal to the one-process step.

Every rank holds the whole collated batch (the same padding everywhere) and trains its share:
of each mini-batch (`workers.trainer.step.mini_batches`, whole groups) rank r takes the r-th of
`world` contiguous, near-equal slices of samples. The loss of a share is normalised by the
*mini-batch's* token and sequence counts, not the share's, and scaled by `world`, because FSDP2's
reduce-scatter averages gradients over ranks: the average of `world × share gradient` is the sum
of the shares' gradients, which is the gradient of the one-process loss. Clipping uses the global
norm (the gradients are DTensors, `clip_grad_norm_` reduces over the mesh), so the update equals
the one-process update up to float summation order (`rollout bench fsdp` measures it).

Invariants:
- Every rank runs the same number of forwards and backwards per update (FSDP2 all-gathers per
  layer per forward): a rank whose share has fewer micro-batches, or none, runs the missing
  ones on one sample with weight 0. Its parameters still receive (zero) gradients in step.
- The step's metrics are those of the whole batch: the micro-batch parts of every rank are
  gathered (a zero row stands for a weight-0 micro-batch; `summarize` ignores rows of 0 tokens).
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
from workers.trainer.loss import summarize
from workers.trainer.step import UpdateCounts, micro_loss, train_step

__all__ = ["shard_bounds", "sharded_train_step"]


def shard_bounds(count: int, rank: int, world: int) -> tuple[int, int]:
    """The rank's contiguous slice [lo, hi) of `count` items (sizes differ by at most one)."""
    return (rank * count) // world, ((rank + 1) * count) // world


def _update(
    model: Any,
    optimizer: torch.optim.Optimizer,
    mb: TrajectoryBatch,
    config: TrainerConfig,
    *,
    rank: int,
    world: int,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    optimizer.zero_grad(set_to_none=True)
    counts = UpdateCounts.of(mb, config)  # the mini-batch's, global: not the share's
    lo, hi = shard_bounds(len(mb), rank, world)
    largest = -(-len(mb) // world)
    micro_count = max(1, -(-largest // config.micro_batch_size))
    micros = [(m, 1.0) for m in mb.select(lo, hi).split(config.micro_batch_size)] if hi > lo else []
    micros += [(mb.select(0, 1), 0.0)] * (micro_count - len(micros))
    rows: list[list[float]] = []
    keys: list[str] = []
    local_loss = torch.zeros((), dtype=torch.float64)
    for micro, weight in micros:
        out = micro_loss(model, micro, config, counts)
        (out.loss * (world * weight)).backward()
        keys = sorted(out.metrics)
        rows.append([out.metrics[k] * weight for k in keys] if weight else [0.0] * len(keys))
        local_loss += float(out.loss.detach()) * weight
    # The global norm over every shard; max_norm inf when unclipped (the factor is then 1).
    norm = torch.nn.utils.clip_grad_norm_(
        list(model.parameters()), config.max_grad_norm or float("inf")
    )
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    grad_norm = float(norm)
    if math.isfinite(grad_norm):  # the same on every rank: the norm is global
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(local_loss)
    parts = _gather_parts(rows, keys, world)
    metrics = summarize(parts)
    metrics.update(
        loss=float(local_loss),
        grad_norm=grad_norm,
        skipped_nonfinite=float(not math.isfinite(grad_norm)),
    )
    return metrics, parts


def _gather_parts(rows: list[list[float]], keys: list[str], world: int) -> list[dict[str, float]]:
    """Every rank's micro-batch metrics (equal row counts by construction), real rows only.

    A min/max field of a zero row would be 0; rows of 0 tokens are dropped here, which is what
    `summarize` would ignore for min/max and what adds nothing to its sums."""
    local = torch.tensor(rows, dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    tokens = keys.index("tokens")
    return [
        dict(zip(keys, row.tolist(), strict=True))
        for part in gathered
        for row in part
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
    ref_model: Any | None = None,
) -> dict[str, Any]:
    """`workers.trainer.step.train_step` for rank `rank` of `world`; same metrics, same update.

    Every rank must call it with the same `batch` (see the module docstring)."""
    update = functools.partial(_update, rank=rank, world=world)
    return train_step(model, optimizer, batch, config, ref_model=ref_model, update=update)
