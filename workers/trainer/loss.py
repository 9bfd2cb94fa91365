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
    L_t  = w_t · min(L_t / w_t, −A_t c)          where A_t < 0, with dual-clip c (`clip_ratio_c`)
    loss = agg(L) − β · agg(H) + κ · agg(KL(π_θ ‖ π_ref))

where w is detached (a constant weight, like verl's `rollout_is_weights`), H_t the entropy of
the current policy at t, β = `entropy_coeff`, κ = `kl_coef` against a frozen reference
policy (estimators below), and `agg` one of verl's `loss_agg_mode`s over m_t = 1:

    token-mean               Σ_t m L / N                 N = Σ m over the whole update
    seq-mean-token-sum       Σ_i (Σ_t m L)_i / S         S = sequences in the whole update
    seq-mean-token-mean      Σ_i (Σ_t m L / Σ_t m)_i / S
    seq-mean-token-sum-norm  Σ_t m L / (S · T)           T = a fixed length (`norm_length`)

N and S are those of the whole optimiser update (pass `token_count`/`seq_count` when an
update is split into micro-batches, so the micro-batch losses add up to the update's).

KL estimators of KL(π_θ ‖ π_ref) per token, with x = log π_θ − log π_ref (Schulman's k1/k2/k3;
verl's `kl_loss_type` names in brackets), exactly as verl computes them: k1 = x [`kl`],
k2 = x²/2 [`mse`], both unclamped; k3 = exp(d) − d − 1 with d = clamp(−x, ±20) [`low_var_kl`]
(clamped before the exponential, which would overflow, and so make the gradient NaN, for x
below about −88), the result clamped to [−10, 10]. Masked positions (m_t = 0) are set to x = 0
before any of it, so a tool token far from the reference cannot poison the gradient.

With one optimiser update per step the proximal policy is the current one: pass
`old_log_prob = log_prob.detach()`, then r_t = 1 in value (gradient ∇ log π_θ), the clip
never acts and the loss is the truncated-IS policy gradient. With several mini-batches or
epochs per step (`workers.trainer.step`) the proximal policy is the one before the step,
the current one moves away from it, and the clip bounds that move. AReaL masks tokens whose
weight exceeds the cap; this module truncates (verl's `rollout_is_mode: truncate`).

Metrics (floats, over m_t = 1): `pg_clipfrac` (verl's: fraction where the clipped term is
the larger), `pg_clipfrac_lower` (share where the dual clip acts), `ppo_kl` =
mean(log π_prox − log π_θ) (verl's approx-KL of the update), `is_weight_mean/min/max` of the
applied w, `is_weight_raw_max` before the cap, `is_truncated_frac`, `behav_kl` =
mean(log π_behav − log π_prox), `entropy`, `kl_ref` (the estimator's mean), `tokens`; for a
MoE batch with recorded routing, `summarize` adds `router_mismatch_rate` (and
`router_live_mismatch_rate` under replay) from the parts' `router_*` counts
(`workers.trainer.router_replay`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "KL_ESTIMATORS",
    "METRIC_KEYS",
    "LossAggMode",
    "PolicyLoss",
    "agg_loss",
    "entropy_from_logits",
    "importance_weights",
    "kl_penalty",
    "policy_loss",
    "summarize",
]

_SAFETY = 20.0
_KL_BOUND = 10.0

LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
KLEstimator = Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"]
KL_ESTIMATORS: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
#: The keys of `PolicyLoss.metrics`, every call the same.
METRIC_KEYS = (
    "tokens",
    "pg_loss_sum",
    "pg_clipfrac_sum",
    "pg_clipfrac_lower_sum",
    "ppo_kl_sum",
    "is_weight_sum",
    "is_weight_min",
    "is_weight_max",
    "is_weight_raw_max",
    "is_truncated_sum",
    "behav_kl_sum",
    "entropy_sum",
    "kl_ref_sum",
)


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


def kl_penalty(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    estimator: KLEstimator,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) (module docstring); 0 where `mask` is 0, whose
    positions never enter the arithmetic (no inf there to multiply by a zero weight)."""
    kind = KL_ESTIMATORS.get(estimator, estimator)
    x = log_prob - ref_log_prob
    if mask is not None:
        x = torch.where(mask > 0, x, torch.zeros_like(x))
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x.square()
    if kind == "k3":
        d = (-x).clamp(-_SAFETY, _SAFETY)  # verl's low_var_kl: clamp, then exp
        return (torch.exp(d) - d - 1.0).clamp(-_KL_BOUND, _KL_BOUND)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def agg_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    *,
    token_count: float | None = None,
    seq_count: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Aggregate per-token `values` [B, T] over `mask` by `mode` (module docstring)."""
    if mode == "token-mean":
        n = token_count if token_count is not None else float(mask.sum().item())
        return _masked_sum(values, mask) / max(n, 1.0)
    s = seq_count if seq_count is not None else float(values.shape[0])
    s = max(s, 1.0)
    if mode == "seq-mean-token-sum":
        return _masked_sum(values, mask, dim=-1).sum() / s
    if mode == "seq-mean-token-mean":
        per_seq = _masked_sum(values, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / s
    if mode == "seq-mean-token-sum-norm":
        t = norm_length if norm_length is not None else float(values.shape[-1])
        return _masked_sum(values, mask) / (s * max(t, 1.0))
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


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
    clip_ratio_c: float | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_level: Literal["token", "sequence", "geometric"] = "token",
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_loss_type: KLEstimator = "k3",
    loss_agg_mode: LossAggMode = "token-mean",
    token_count: float | None = None,
    seq_count: float | None = None,
    norm_length: float | None = None,
) -> PolicyLoss:
    """The loss of the module docstring for tensors of shape [B, T] (responses only).

    `token_count`/`seq_count` are N and S of the aggregation (default: this call's);
    metrics are computed over this call's tokens. Raises ValueError when shapes differ.
    """
    shapes = {tuple(t.shape) for t in (log_prob, old_log_prob, rollout_log_prob, advantages)}
    if len(shapes) != 1 or tuple(response_mask.shape) not in shapes:
        raise ValueError(f"policy_loss: shapes differ: {sorted(shapes)} vs {response_mask.shape}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must exceed 1, got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return agg_loss(
            values,
            mask,
            loss_agg_mode,
            token_count=token_count,
            seq_count=seq_count,
            norm_length=norm_length,
        )

    weight, raw = importance_weights(
        old_log_prob, rollout_log_prob, mask, cap=rollout_is_threshold, level=rollout_is_level
    )
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio.clamp(-_SAFETY, _SAFETY))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(pg, dtype=torch.bool)
    if clip_ratio_c is not None:
        # Dual clip (Ye et al. 2020): with A < 0 a huge ratio must not make the loss unbounded.
        bound = -advantages * clip_ratio_c
        lower = (advantages < 0) & (pg > bound)
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    per_token = pg * weight
    loss = agg(per_token)
    if entropy is not None and entropy_coeff:
        loss = loss - entropy_coeff * agg(entropy)
    kl = None
    if ref_log_prob is not None:
        kl = kl_penalty(log_prob, ref_log_prob.detach(), kl_loss_type, mask)
        if kl_coef:
            loss = loss + kl_coef * agg(kl)

    with torch.no_grad():  # one device-to-host copy for every figure (a GPU waits once)
        valid = mask > 0
        inf = torch.full_like(weight, float("inf"))
        zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
        values = {
            "tokens": mask.sum(),
            "pg_loss_sum": _masked_sum(per_token, mask),
            "pg_clipfrac_sum": _masked_sum((clipped > unclipped).to(mask.dtype), mask),
            "pg_clipfrac_lower_sum": _masked_sum(lower.to(mask.dtype), mask),
            "ppo_kl_sum": _masked_sum(-log_ratio, mask),
            "is_weight_sum": weight.sum(),
            "is_weight_min": torch.where(valid, weight, inf).min(),
            "is_weight_max": torch.where(valid, weight, -inf).max(),
            "is_weight_raw_max": torch.where(valid, raw, -inf).max(),
            "is_truncated_sum": _masked_sum((raw > rollout_is_threshold).to(mask.dtype), mask),
            "behav_kl_sum": _masked_sum(rollout_log_prob - old_log_prob, mask),
            "entropy_sum": _masked_sum(entropy, mask) if entropy is not None else zero,
            "kl_ref_sum": _masked_sum(kl, mask) if kl is not None else zero,
        }
        floats = torch.stack([v.to(torch.float64) for v in values.values()]).tolist()
        metrics = dict(zip(values, floats, strict=True))
        if not metrics["tokens"]:  # no trained token: no extremes
            for key in ("is_weight_min", "is_weight_max", "is_weight_raw_max"):
                metrics[key] = float("nan")
    return PolicyLoss(loss=loss, metrics=metrics)


def summarize(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine the metrics of micro-batches (of one update or a whole step) into means and
    extremes."""
    tokens = sum(p["tokens"] for p in parts) or 1.0
    out = {
        "tokens": sum(p["tokens"] for p in parts),
        "pg_loss": sum(p["pg_loss_sum"] for p in parts) / tokens,
        "pg_clipfrac": sum(p["pg_clipfrac_sum"] for p in parts) / tokens,
        "pg_clipfrac_lower": sum(p["pg_clipfrac_lower_sum"] for p in parts) / tokens,
        "ppo_kl": sum(p["ppo_kl_sum"] for p in parts) / tokens,
        "kl_ref": sum(p["kl_ref_sum"] for p in parts) / tokens,
        "is_weight_mean": sum(p["is_weight_sum"] for p in parts) / tokens,
        "is_truncated_frac": sum(p["is_truncated_sum"] for p in parts) / tokens,
        "behav_kl": sum(p["behav_kl_sum"] for p in parts) / tokens,
        "entropy": sum(p["entropy_sum"] for p in parts) / tokens,
    }
    finite = [p for p in parts if p["tokens"] > 0]
    out["is_weight_min"] = min((p["is_weight_min"] for p in finite), default=float("nan"))
    out["is_weight_max"] = max((p["is_weight_max"] for p in finite), default=float("nan"))
    out["is_weight_raw_max"] = max((p["is_weight_raw_max"] for p in finite), default=float("nan"))
    out.update(_routing_rates(parts))
    return out


def _routing_rates(parts: list[dict[str, float]]) -> dict[str, float]:
    """`router_mismatch_rate` (and, under replay, `router_live_mismatch_rate`) over the
    recorded response (token, layer) rows of MoE batches (`workers.trainer.router_replay`);
    nothing for a dense model or a batch without recorded routing."""
    rows = sum(p.get("router_rows", 0.0) for p in parts)
    if not rows:
        return {}
    out = {
        "router_rows": rows,
        "router_mismatch_rate": sum(p.get("router_mismatch_sum", 0.0) for p in parts) / rows,
    }
    if any("router_live_mismatch_sum" in p for p in parts):
        live = sum(p.get("router_live_mismatch_sum", 0.0) for p in parts)
        out["router_live_mismatch_rate"] = live / rows
    return out
