"""The LM head's logprobs and entropy in chunks of tokens, as one autograd function that never
keeps a [tokens, vocabulary] tensor.

For hidden states h (N, H), the head W (V, H) (and bias b), targets t (N,), with
z = h Wᵀ + b in fp32, log p = z − lse(z):

    forward   logp_i = z_{i,t_i} − lse_i,   H_i = −Σ_v p_{i,v} log p_{i,v}
    backward  ∂L/∂z = −p ⊙ (g_logp + g_H ⊙ (log p + H)) + g_logp · onehot(t)
              ∂L/∂h = (∂L/∂z) W,   ∂L/∂W = (∂L/∂z)ᵀ h,   ∂L/∂b = Σ_i ∂L/∂z_i

The forward keeps only lse and H (N floats each); the backward recomputes z one chunk at a time
(one matmul) and works in place on that chunk's buffer, so memory holds O(chunk × V) at any
time and the elementwise passes over it are about half of what autograd through
log-softmax/gather/entropy with recomputation (activation checkpointing) takes.

Precision: the matmuls run in the dtype autocast gives them (bf16 under `trainer.precision
bf16`, as the model's own head would), everything after in fp32; the gradients of h and W come
back in their own dtypes. Checked against the plain autograd computation in
tests/unit/workers/trainer/test_packing.py (within 1e-6, fp32).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["chunked_head"]


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    z = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        z = z + bias.to(dtype)
    return z.float()


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden, weight)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                z = _logits(hidden[lo:hi], weight, bias, dtype)
                log_p = torch.log_softmax(z, dim=-1)  # torch's, to the last bit of the reference
                lse[lo:hi] = z[:, 0] - log_p[:, 0]
                del z
                logp[lo:hi] = log_p.gather(-1, targets[lo:hi, None]).squeeze(-1)
                entropy[lo:hi] = -log_p.exp().mul_(log_p).sum(dim=-1)
                del log_p
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk, ctx.dtype = chunk, dtype
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None) -> Any:  # type: ignore[override]
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        n = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        grad_b = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if need_b and bias is not None
            else None
        )
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                z = _logits(hidden[lo:hi], weight, bias, dtype)
                z.sub_(lse[lo:hi, None])  # log p
                p = z.exp()
                g = g_logp[lo:hi, None].float()
                if g_entropy is not None:  # z ← −(g_logp + g_H (log p + H))
                    z.add_(entropy[lo:hi, None]).mul_(-g_entropy[lo:hi, None].float()).sub_(g)
                    grad_z = p.mul_(z)
                else:
                    grad_z = p.mul_(-g)
                del z
                grad_z.scatter_add_(-1, targets[lo:hi, None], g)
                gz = grad_z.to(dtype)
                if grad_h is not None:
                    grad_h[lo:hi] = (gz @ weight.to(dtype)).to(hidden.dtype)
                if grad_w is not None:
                    grad_w.add_(gz.t() @ hidden[lo:hi].to(dtype))
                if grad_b is not None:
                    grad_b.add_(grad_z.sum(dim=0))
                del grad_z, gz
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None


def chunked_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (N,) fp32, of the head (`weight`, `bias`) on `hidden` (N, H) at
    `targets` (N,), `chunk` rows at a time (module docstring); both differentiable."""
    return _ChunkedHead.apply(hidden, weight, bias, targets, chunk)  # type: ignore[no-any-return]
