"""Attention over packed sequences: exact (no token attends across a sequence boundary) and
without compute on the blocks between sequences.

A packed forward feeds one row of T tokens, the micro-batch's sequences concatenated, with
position ids restarting at 0 for each (`workers.trainer.packing`). Measured with the installed
transformers (`../shared/gpu/README.md`): position ids alone do not keep `sdpa` inside a
sequence, and an explicit [T, T] block-causal mask is exact but spends the whole T² on blocks
it then masks. So the decoder runs, for the duration of one packed forward, under an attention
implementation of its own (`PACKED`, registered with transformers' `AttentionInterface`) that
receives the sequences' boundaries as `cu_seq_lens_q` (int32, [n + 1], transformers' varlen
keyword, passed through the model's forward) and computes causal attention per sequence:

- CUDA, bf16/fp16: `flash_attn`'s varlen kernel through transformers' `flash_attention_2` where
  that package is installed, else torch's `varlen_attn` where this torch has one;
- anywhere else (CPU; fp32 on a GPU): `scaled_dot_product_attention(is_causal=True)` on each
  sequence's slice. The cost is Σ Lᵢ² (what the padded layout pays per row), never T².

Invariants:
- `packed_attention(model)` switches only the decoder's config (`model.get_decoder().config`,
  which its attention layers share), so a vision tower keeps its own attention, and it restores
  the previous implementation on exit, also when the forward raises. No mask is built for a
  packed forward (transformers builds masks only for implementations it registered masks for).
- A forward under `PACKED` without `cu_seq_lens_q` is an error, not a silent causal row.
- Sliding-window layers, attention logit capping and attention sinks are refused
  (`TrainerError`): none of the paths here applies them (set `trainer.packed: false`).
- A fused path that fails on its first call (an older torch's `varlen_attn` signature, a GPU
  it does not support) is logged once and replaced by the per-sequence path for the process.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from workers.trainer.exceptions import TrainerError

__all__ = ["PACKED", "attention_path", "packed_attention", "packed_attention_forward"]

log = logging.getLogger("rollout.trainer.attention")

PACKED = "rollout_packed"

_FAILED: set[str] = set()  # fused paths that failed once in this process (module docstring)


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _varlen() -> Any | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def attention_path(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a packed forward of `dtype` activations on `device` runs: `flash_attention_2`,
    `varlen` or `per_sequence_sdpa` (module docstring)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        if _has_flash_attn() and "flash_attention_2" not in _FAILED:
            return "flash_attention_2"
        if _varlen() is not None and "varlen" not in _FAILED:
            return "varlen"
    return "per_sequence_sdpa"


def _per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    scaling: float | None,
) -> torch.Tensor:
    """(1, H, T, D) q and (1, Hkv, T, D) k/v → (1, T, H, D), causal within each sequence."""
    gqa = key.shape[1] != query.shape[1]
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, lo:hi],
            key[:, :, lo:hi],
            value[:, :, lo:hi],
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _torch_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_length: int,
    scaling: float | None,
) -> torch.Tensor:
    varlen_attn = _varlen()
    assert varlen_attn is not None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    params = inspect.signature(varlen_attn).parameters
    extra: dict[str, Any] = {"scale": scaling}
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    cu = cu.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, max_length, max_length, **extra)
    return out.unsqueeze(0)  # (1, T, H, D)


def packed_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The `AttentionInterface` function of `PACKED` (module docstring)."""
    if cu_seq_lens_q is None:
        raise TrainerError("a packed forward needs cu_seq_lens_q (workers.trainer.packing)")
    if sliding_window is not None:
        raise TrainerError("packed attention has no sliding window; this layer has one")
    if dropout:
        raise TrainerError("packed attention runs without attention dropout")
    unsupported = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported:  # attention logit capping (Gemma 2), sinks (GPT-OSS): not computed here
        raise TrainerError(f"packed attention does not apply {', '.join(unsupported)}")
    path = attention_path(query.device, query.dtype)
    max_length = int(max_length_q) if max_length_q is not None else query.shape[2]
    if path == "flash_attention_2":
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            flash = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
            return flash(
                module,
                query,
                key,
                value,
                None,
                scaling=scaling,
                cu_seq_lens_q=cu_seq_lens_q,
                cu_seq_lens_k=cu_seq_lens_q,
                max_length_q=max_length,
                max_length_k=max_length,
                **kwargs,
            )
        except (ImportError, RuntimeError, TypeError, ValueError) as exc:
            _fail(path, exc)
    elif path == "varlen":
        try:
            return _torch_varlen(query, key, value, cu_seq_lens_q, max_length, scaling), None
        except (RuntimeError, TypeError, ValueError) as exc:
            _fail(path, exc)
    bounds = [int(x) for x in cu_seq_lens_q.tolist()]
    return _per_sequence(query, key, value, bounds, scaling), None


def _fail(path: str, exc: Exception) -> None:
    _FAILED.add(path)
    log.warning("packed attention: %s failed (%s); per-sequence sdpa from now on", path, exc)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED, packed_attention_forward)


@contextmanager
def packed_attention(model: Any) -> Iterator[None]:
    """The decoder of `model` attends through `PACKED` inside the block (module docstring)."""
    _register()
    config = model.get_decoder().config
    previous = config._attn_implementation_internal
    config._attn_implementation_internal = PACKED
    try:
        yield
    finally:
        config._attn_implementation_internal = previous
