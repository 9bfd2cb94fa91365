"""One optimiser step of the policy on a padded batch (`workers.trainer.batching` layout).

The step recomputes the current policy's logprobs of every response token (teacher forcing
over `input_ids`), takes the proximal policy to be the current one (one update per step, so
`old_log_prob = log_prob.detach()`), weights each token by the truncated behaviour importance
weight against the rollout logprobs (`batch["old_logprobs"]`) and minimises the PPO-clip loss
of `workers.trainer.loss`, token-mean over the whole batch, accumulated over micro-batches.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workers.trainer.batching import TrajectoryBatch
from workers.trainer.config import TrainerConfig
from workers.trainer.exceptions import DeviceError
from workers.trainer.loss import entropy_from_logits, policy_loss, summarize

__all__ = ["resolve_device", "response_log_probs", "train_step"]


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


def response_log_probs(
    model: Any, batch: TrajectoryBatch, *, entropy_grad: bool = False, precision: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(response token) [B, R] and the entropy at each response position [B, R].

    The entropy carries a gradient only with `entropy_grad` (an entropy bonus in the loss).
    With `precision="bf16"` the model runs under bf16 autocast; the log-softmax and what
    follows are fp32 either way.
    """
    p = batch.prompt_length
    responses = batch["responses"]
    r = responses.shape[1]
    input_ids = batch["input_ids"]
    with torch.autocast(input_ids.device.type, torch.bfloat16, enabled=precision == "bf16"):
        out = model(
            input_ids=input_ids,
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        )
    logits = out.logits[:, p - 1 : p + r - 1, :].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        entropy = entropy_from_logits(logits)
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return logp, entropy


def train_step(
    model: Any, optimizer: torch.optim.Optimizer, batch: TrajectoryBatch, config: TrainerConfig
) -> dict[str, float]:
    """Forward/backward every micro-batch, clip, step; returns the step's metrics."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    token_count = float(batch["response_mask"].sum().item())
    normaliser = max(token_count, 1.0)
    parts = []
    total = 0.0
    for mb in batch.split(config.micro_batch_size):
        logp, entropy = response_log_probs(
            model, mb, entropy_grad=config.entropy_coeff > 0, precision=config.precision
        )
        out = policy_loss(
            logp,
            logp.detach(),
            mb["old_logprobs"],
            mb["advantages"],
            mb["response_mask"],
            clip_ratio_low=config.clip_ratio_low,
            clip_ratio_high=config.clip_ratio_high,
            rollout_is_threshold=config.rollout_is_threshold,
            rollout_is_level=config.rollout_is_level,
            entropy=entropy,
            entropy_coeff=config.entropy_coeff,
            token_count=normaliser,
        )
        out.loss.backward()
        total += float(out.loss.detach())
        parts.append(out.metrics)
    params = [p for p in model.parameters() if p.grad is not None]
    if config.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    grad_norm = float(norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = summarize(parts)
    metrics["loss"] = total
    metrics["grad_norm"] = grad_norm
    metrics["skipped_nonfinite"] = 0.0 if math.isfinite(grad_norm) else 1.0
    return metrics
