"""The policy loss: PPO-clip, corrected for the behaviour policy by truncated importance weights.

Pure torch, no state. Three policies meet here (decoupled PPO, as in AReaL; verl's names in
brackets):

- behaviour  π_behav  the replica weights that sampled the tokens   [`rollout_log_probs`]
- proximal   π_prox   the trainer's policy before this update       [`old_log_prob`]
- current    π_θ      the policy being optimised                   [`log_prob`]

For every response token t (m_t = `response_mask`, 1 for model tokens, 0 for tool/user
tokens and padding), with A_t the advantage:

    r_t  = exp(log π_θ(t) − log π_prox(t))                              PPO ratio
    ρ_t  = exp(clamp(log π_prox(t) − log π_behav(t), −20, 20))          behaviour ratio
    w_t  = min(ρ_t, C)                            level = token     (verl TIS, truncate mode)
    w_t  = min(exp(clamp(Σ_s m_s log ρ_s, ±20)), C)          level = sequence
    w_t  = min(exp(clamp(Σ_s m_s log ρ_s / Σ_s m_s, ±20)), C) level = geometric
    L_t  = w_t · max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))
    loss = Σ_t m_t L_t / N  −  β · Σ_t m_t H_t / N                      token-mean

where w is detached (a constant weight, like verl's `rollout_is_weights`), H_t the entropy of
the current policy at t, β = `entropy_coeff`, and N = Σ m_t over the *whole step* (pass
`token_count` when a step is split into micro-batches, so the micro-batch losses add up to
the step's token mean). With one optimiser update per step the proximal policy is the current
one: pass `old_log_prob = log_prob.detach()`, then r_t = 1 in value (gradient ∇ log π_θ),
the clip is inactive and the loss is the truncated-IS policy gradient. AReaL masks tokens
whose weight exceeds the cap; this module truncates (verl's `rollout_is_mode: truncate`).

Metrics (floats, over m_t = 1): `pg_clipfrac` (verl's: fraction where the clipped term is
the larger), `is_weight_mean/min/max` of the applied w, `is_weight_raw_max` before the cap,
`is_truncated_frac`, `behav_kl` = mean(log π_behav − log π_prox), `entropy`, `tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "PolicyLoss",
    "entropy_from_logits",
    "importance_weights",
    "policy_loss",
    "summarize",
]

_SAFETY = 20.0


@dataclass
class PolicyLoss:
    """The loss to backpropagate and its metrics (sums and extremes, for aggregation)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim=dim)


def importance_weights(
    prox_log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    level: Literal["token", "sequence", "geometric"] = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated w, raw ρ) per token, both [B, T], detached, zero where `mask` is 0."""
    log_ratio = (prox_log_prob - behav_log_prob).detach() * mask
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        log_w = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        count = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        log_w = (log_ratio.sum(dim=-1, keepdim=True) / count).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown importance-weight level {level!r}")
    raw = torch.exp(log_w.clamp(-_SAFETY, _SAFETY))
    return raw.clamp(max=cap) * mask, raw * mask


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at every position ([..., V] → [...])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_threshold: float = 2.0,
    rollout_is_level: Literal["token", "sequence", "geometric"] = "token",
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    token_count: float | None = None,
) -> PolicyLoss:
    """The loss of the module docstring for tensors of shape [B, T] (responses only).

    `token_count` is N of the formula (default: this call's Σ m_t); metrics are computed over
    this call's tokens. Raises ValueError when shapes differ.
    """
    shapes = {tuple(t.shape) for t in (log_prob, old_log_prob, rollout_log_prob, advantages)}
    if len(shapes) != 1 or tuple(response_mask.shape) not in shapes:
        raise ValueError(f"policy_loss: shapes differ: {sorted(shapes)} vs {response_mask.shape}")
    mask = response_mask.to(log_prob.dtype)
    tokens = float(mask.sum().item())
    n = float(token_count) if token_count is not None else max(tokens, 1.0)

    weight, raw = importance_weights(
        old_log_prob, rollout_log_prob, mask, cap=rollout_is_threshold, level=rollout_is_level
    )
    ratio = torch.exp((log_prob - old_log_prob.detach()).clamp(-_SAFETY, _SAFETY))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped) * weight
    loss = _masked_sum(per_token, mask) / n
    if entropy is not None and entropy_coeff:
        loss = loss - entropy_coeff * _masked_sum(entropy, mask) / n

    with torch.no_grad():
        valid = mask > 0
        any_valid = bool(valid.any())
        metrics = {
            "tokens": tokens,
            "pg_loss_sum": float(_masked_sum(per_token, mask)),
            "pg_clipfrac_sum": float(_masked_sum((clipped > unclipped).to(mask.dtype), mask)),
            "is_weight_sum": float(weight.sum()),
            "is_weight_min": float(weight[valid].min()) if any_valid else float("nan"),
            "is_weight_max": float(weight[valid].max()) if any_valid else float("nan"),
            "is_weight_raw_max": float(raw[valid].max()) if any_valid else float("nan"),
            "is_truncated_sum": float(
                _masked_sum((raw > rollout_is_threshold).to(mask.dtype), mask)
            ),
            "behav_kl_sum": float(_masked_sum(rollout_log_prob - old_log_prob, mask)),
            "entropy_sum": float(_masked_sum(entropy, mask)) if entropy is not None else 0.0,
        }
    return PolicyLoss(loss=loss, metrics=metrics)


def summarize(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine the metrics of a step's micro-batches into means and extremes."""
    tokens = sum(p["tokens"] for p in parts) or 1.0
    out = {
        "tokens": sum(p["tokens"] for p in parts),
        "pg_loss": sum(p["pg_loss_sum"] for p in parts) / tokens,
        "pg_clipfrac": sum(p["pg_clipfrac_sum"] for p in parts) / tokens,
        "is_weight_mean": sum(p["is_weight_sum"] for p in parts) / tokens,
        "is_truncated_frac": sum(p["is_truncated_sum"] for p in parts) / tokens,
        "behav_kl": sum(p["behav_kl_sum"] for p in parts) / tokens,
        "entropy": sum(p["entropy_sum"] for p in parts) / tokens,
    }
    finite = [p for p in parts if p["tokens"] > 0]
    out["is_weight_min"] = min((p["is_weight_min"] for p in finite), default=float("nan"))
    out["is_weight_max"] = max((p["is_weight_max"] for p in finite), default=float("nan"))
    out["is_weight_raw_max"] = max((p["is_weight_raw_max"] for p in finite), default=float("nan"))
    return out
