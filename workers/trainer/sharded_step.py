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

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from workers.trainer.batching import TrajectoryBatch
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import policy_loss, summarize
from workers.trainer.step import _log_probs, mini_batches, response_log_probs

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
    proximal: bool,
    rank: int,
    world: int,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    optimizer.zero_grad(set_to_none=True)
    token_count = max(float(mb["response_mask"].sum().item()), 1.0)  # the mini-batch's, global
    seq_count = float(len(mb))
    lo, hi = shard_bounds(len(mb), rank, world)
    largest = -(-len(mb) // world)
    micro_count = max(1, -(-largest // config.micro_batch_size))
    micros = [(m, 1.0) for m in mb.select(lo, hi).split(config.micro_batch_size)] if hi > lo else []
    micros += [(mb.select(0, 1), 0.0)] * (micro_count - len(micros))
    rows: list[list[float]] = []
    keys: list[str] = []
    local_loss = torch.zeros((), dtype=torch.float64)
    for micro, weight in micros:
        logp, entropy = response_log_probs(
            model, micro, entropy_grad=config.entropy_coeff > 0, precision=config.precision
        )
        out = policy_loss(
            logp,
            micro["prox_logprobs"] if proximal else logp.detach(),
            micro["old_logprobs"],
            micro["advantages"],
            micro["response_mask"],
            clip_ratio_low=config.clip_ratio_low,
            clip_ratio_high=config.clip_ratio_high,
            clip_ratio_c=config.clip_ratio_c,
            rollout_is_threshold=config.rollout_is_threshold,
            rollout_is_level=config.rollout_is_level,
            entropy=entropy,
            entropy_coeff=config.entropy_coeff,
            ref_log_prob=micro.tensors.get("ref_logprobs"),
            kl_coef=config.kl_coef,
            kl_loss_type=config.kl_loss_type,
            loss_agg_mode=config.loss_agg_mode,
            token_count=token_count,
            seq_count=seq_count,
            norm_length=float(config.loss_norm_length or mb["responses"].shape[1]),
        )
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
    model.train()
    batch = dataclasses.replace(batch, tensors=dict(batch.tensors))
    if config.mask_truncated and "truncated" in batch.tensors:
        keep = (1.0 - batch["truncated"].to(batch["response_mask"].dtype)).unsqueeze(-1)
        batch.tensors["response_mask"] = batch["response_mask"] * keep
        batch.tensors["advantages"] = batch["advantages"] * keep
    proximal = config.ppo_epochs * config.ppo_mini_batches > 1
    if proximal:
        batch.tensors["prox_logprobs"] = _log_probs(model, batch, config)
    if ref_model is not None:
        batch.tensors["ref_logprobs"] = _log_probs(ref_model, batch, config)
    minis = mini_batches(batch, config.ppo_mini_batches)
    per_update: list[dict[str, float]] = []
    parts: list[dict[str, float]] = []
    for epoch in range(config.ppo_epochs):
        for index, mb in enumerate(minis):
            metrics, mb_parts = _update(
                model, optimizer, mb, config, proximal=proximal, rank=rank, world=world
            )
            per_update.append({"epoch": float(epoch), "mini_batch": float(index), **metrics})
            parts += mb_parts
    out: dict[str, Any] = summarize(parts)
    norms = [u["grad_norm"] for u in per_update]
    out["loss"] = sum(u["loss"] for u in per_update) / len(per_update)
    out["grad_norm"] = sum(norms) / len(norms)
    out["grad_norm_max"] = max(norms)
    out["skipped_nonfinite"] = sum(u["skipped_nonfinite"] for u in per_update)
    out["optimizer_updates"] = float(len(per_update))
    adv = batch["advantages"]
    out["zero_advantage"] = float(not bool((adv.abs() * batch["response_mask"] > 1e-8).any()))
    out["updates"] = per_update
    return out
