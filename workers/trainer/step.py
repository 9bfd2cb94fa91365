"""One optimiser step of the policy on a padded batch (`workers.trainer.batching` layout).

A step is `ppo_epochs` passes over `ppo_mini_batches` mini-batches of the step's groups
(whole groups each), one optimiser update per mini-batch, each accumulated over micro-batches
of `micro_batch_size` samples. Every update recomputes the current policy's logprobs of the
response tokens (teacher forcing over `input_ids`), weights each token by the truncated
behaviour importance weight against the rollout logprobs (`batch["old_logprobs"]`) and
minimises the loss of `workers.trainer.loss`, aggregated over the update's tokens.

The proximal policy of the PPO ratio is the policy before the step: with one update it is
the current one (`log_prob.detach()`, no extra forward, the clip never acts); with several,
its logprobs are computed once before the first update, so later updates see the ratio move
and the clip bound it (decoupled PPO: behaviour → proximal → current).

A batch of a Mixture-of-Experts policy may carry the rollout's routing
(`batch.routed_experts`, `workers.trainer.router_replay`): every forward of the step (with
grad, proximal, reference) runs under `RouterReplay`, which replays it with
`router_replay='r3'` and only observes it with `off`; the micro-batches' metrics count the
recorded response rows and those where the experts used differ (`router_mismatch_rate`).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from workers.trainer.batching import TrajectoryBatch
from workers.trainer.config import TrainerConfig
from workers.trainer.exceptions import DeviceError
from workers.trainer.logprobs import forward_log_probs, response_log_probs
from workers.trainer.loss import policy_loss, summarize
from workers.trainer.micro_batches import micro_batch_indices, micro_batches
from workers.trainer.packing import Layout, layout
from workers.trainer.router_replay import RouterReplay, batch_routing

__all__ = [
    "micro_batches_of",
    "resolve_device",
    "response_log_probs",
    "response_positions",
    "routing",
    "train_step",
]


def resolve_device(name: str) -> torch.device:
    """`trainer.device` → a torch device this machine has (`auto`: the first GPU, else CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"trainer.device={name}: no CUDA device is visible to torch")
        if (device.index or 0) >= count:
            raise DeviceError(f"trainer.device={name}: torch sees {count} CUDA device(s)")
    return device


def mini_batches(batch: TrajectoryBatch, count: int) -> list[TrajectoryBatch]:
    """`batch` cut into at most `count` slices of whole groups (a group's samples are
    consecutive and share a uid), as even in groups as the group count allows."""
    starts = [i for i in range(len(batch)) if i == 0 or batch.uids[i] != batch.uids[i - 1]]
    k = max(1, min(count, len(starts)))
    bounds = [starts[(j * len(starts)) // k] for j in range(k)] + [len(batch)]
    return [batch.select(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def routing(
    model: Any, batch: TrajectoryBatch, config: TrainerConfig, view: Layout | None = None
) -> RouterReplay:
    """The routing context of one forward of `model` on `batch` in the layout `view` (the
    padded one when None); inert without routing."""
    routed = batch_routing(batch)
    if routed is not None and view is not None:
        routed = view.take(routed)
    return RouterReplay(model, routed, replay=config.router_replay == "r3")


def micro_batches_of(batch: TrajectoryBatch, config: TrainerConfig) -> list[TrajectoryBatch]:
    """The micro-batches of `batch` (`workers.trainer.micro_batches`: by count or tokens)."""
    return micro_batches(batch, config.micro_batch_size, config.max_tokens_per_micro_batch)


def _view(batch: TrajectoryBatch, config: TrainerConfig) -> Layout:
    """The layout of the trainer's own forwards: only the trained tokens go through the head."""
    return layout(batch, packed=config.packed, trained_only=True)


def response_positions(batch: TrajectoryBatch) -> torch.Tensor:
    """(B, P+R) bool: the columns of `input_ids` that hold a trained response token."""
    positions = torch.zeros(
        batch["input_ids"].shape, dtype=torch.bool, device=batch["input_ids"].device
    )
    positions[:, batch.prompt_length :] = batch["response_mask"] > 0
    return positions


def _log_probs(model: Any, batch: TrajectoryBatch, config: TrainerConfig) -> torch.Tensor:
    """Response logprobs without a gradient, micro-batch by micro-batch, as one [B, R]."""
    out = torch.zeros_like(batch["old_logprobs"])
    # Every layout first: building one reads sizes off the device, which must not wait on a
    # forward in flight.
    micros = [(mb, rows, _view(mb, config)) for mb, rows in _with_rows(batch, config)]
    with torch.no_grad():
        for mb, rows, view in micros:
            with routing(model, mb, config, view):
                logp = forward_log_probs(
                    model,
                    mb,
                    view,
                    precision=config.precision,
                    chunk_tokens=config.logprob_chunk_tokens,
                )[0]
            out[rows] = logp
    return out


def _with_rows(
    batch: TrajectoryBatch, config: TrainerConfig
) -> list[tuple[TrajectoryBatch, torch.Tensor]]:
    """The micro-batches of `batch`, each with the batch rows it holds."""
    device = batch["old_logprobs"].device
    size, budget = config.micro_batch_size, config.max_tokens_per_micro_batch
    return [
        (batch.take(rows), torch.tensor(rows, device=device))
        for rows in micro_batch_indices(batch, size, budget)
    ]


#: The settings of `policy_loss` that `TrainerConfig` holds, under the same (verl's) names.
_LOSS_SETTINGS = frozenset(inspect.signature(policy_loss).parameters).intersection(
    TrainerConfig.model_fields
)


@dataclasses.dataclass(frozen=True)
class UpdateCounts:
    """N, S and T of the loss aggregation (`workers.trainer.loss`): those of the whole
    optimiser update, so that the losses of its micro-batches add up to the update's."""

    token_count: float
    seq_count: float
    norm_length: float

    @classmethod
    def of(cls, mb: TrajectoryBatch, config: TrainerConfig) -> UpdateCounts:
        """The counts of the update on the mini-batch `mb`."""
        return cls(
            token_count=max(float(mb["response_mask"].sum().item()), 1.0),
            seq_count=float(len(mb)),
            norm_length=float(config.loss_norm_length or mb["responses"].shape[1]),
        )


def micro_loss(
    model: Any,
    micro: TrajectoryBatch,
    config: TrainerConfig,
    counts: UpdateCounts,
    view: Layout | None = None,
) -> Any:
    """The policy loss of one micro-batch (a forward with grad), normalised by its update's
    `counts` so that the micro-batches' losses add up to the update's; `view` its layout
    (built here when None).

    The proximal policy is the one before the step where `micro["prox_logprobs"]` holds its
    logprobs (several updates per step), else the current one (`log_prob.detach()`)."""
    view = view if view is not None else _view(micro, config)
    with routing(model, micro, config, view) as routed:
        logp, entropy = forward_log_probs(
            model,
            micro,
            view,
            entropy_grad=config.entropy_coeff > 0,
            precision=config.precision,
            chunk_tokens=config.logprob_chunk_tokens,
        )
    prox = micro.tensors.get("prox_logprobs")
    out = policy_loss(
        logp,
        prox if prox is not None else logp.detach(),
        micro["old_logprobs"],
        micro["advantages"],
        micro["response_mask"],
        entropy=entropy,
        ref_log_prob=micro.tensors.get("ref_logprobs"),
        **config.model_dump(include=_LOSS_SETTINGS),
        **dataclasses.asdict(counts),
    )
    out.metrics.update(routed.counts(view.take(response_positions(micro))))
    return out


def _update(
    model: Any, optimizer: torch.optim.Optimizer, mb: TrajectoryBatch, config: TrainerConfig
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """One optimiser update on the mini-batch `mb`: its metrics and its micro-batches' parts."""
    optimizer.zero_grad(set_to_none=True)
    counts = UpdateCounts.of(mb, config)
    parts = []
    total = torch.zeros((), dtype=torch.float64, device=mb["input_ids"].device)
    micros = [(m, _view(m, config)) for m in micro_batches_of(mb, config)]  # no wait later
    for micro, view in micros:
        out = micro_loss(model, micro, config, counts, view)
        out.loss.backward()
        total += out.loss.detach()
        parts.append(out.metrics)
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        norm = torch.zeros(())
    elif config.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    grad_norm = float(norm)
    if math.isfinite(grad_norm) and params:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return update_result(parts, loss=float(total), grad_norm=grad_norm)


def update_result(
    parts: list[dict[str, float]], *, loss: float, grad_norm: float
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """An optimiser update's metrics (its micro-batches' `parts` summarised, its `loss` and
    `grad_norm`, whether a non-finite norm skipped it) and the parts; one- and N-rank alike."""
    metrics = summarize(parts)
    metrics.update(
        loss=loss,
        grad_norm=grad_norm,
        skipped_nonfinite=float(not math.isfinite(grad_norm)),
    )
    return metrics, parts


def train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: TrajectoryBatch,
    config: TrainerConfig,
    *,
    ref_model: Any | None = None,
    update: Callable[..., tuple[dict[str, float], list[dict[str, float]]]] | None = None,
) -> dict[str, float | list[dict[str, float]]]:
    """`ppo_epochs` passes over `ppo_mini_batches` mini-batches of the step's groups, one
    optimiser update each; returns the step's metrics (`updates`: one entry per update).

    With one update the proximal policy is the current one (no extra forward). With more,
    the logprobs of the policy before the step are computed once, up front, and every
    update's PPO ratio is taken against them, so the clip bounds how far the step moves.
    `ref_model` (frozen) gives the reference logprobs of the KL term (`kl_coef`). `update`
    replaces the one-process optimiser update (`update(model, optimizer, mb, config)`; the
    sharded trainer's trains this rank's share).
    """
    update = update or _update
    model.train()
    batch = dataclasses.replace(batch, tensors=dict(batch.tensors))  # the caller's stays as it is
    if config.mask_truncated and "truncated" in batch.tensors:
        keep = (1.0 - batch["truncated"].to(batch["response_mask"].dtype)).unsqueeze(-1)
        batch.tensors["response_mask"] = batch["response_mask"] * keep
        batch.tensors["advantages"] = batch["advantages"] * keep
    updates = config.ppo_epochs * config.ppo_mini_batches
    if updates > 1:  # the proximal policy is the one before the step
        batch.tensors["prox_logprobs"] = _log_probs(model, batch, config)
    if ref_model is not None:
        batch.tensors["ref_logprobs"] = _log_probs(ref_model, batch, config)
    minis = mini_batches(batch, config.ppo_mini_batches)
    per_update: list[dict[str, float]] = []
    parts: list[dict[str, float]] = []
    for epoch in range(config.ppo_epochs):
        for index, mb in enumerate(minis):
            metrics, mb_parts = update(model, optimizer, mb, config)
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
