"""Packing named tensors into flat byte buckets, and reading them back (the manifest).

A transfer sends a model as a few large flat `uint8` buffers instead of hundreds of small
tensors: one collective per bucket, not per tensor. The manifest says where each tensor lies:

    {"buckets": [{"nbytes": N, "tensors": [[name, dtype, shape, offset], ...]}, ...],
     "total_bytes": T}

Invariants:
- A bucket holds at most `bucket_bytes`; a tensor of `alone_bytes` or more travels alone in a
  bucket of its own size, sent from the tensor itself (`alone`) when it travels in its own
  dtype: no copy on the sender. A tensor planned in another dtype (`plan` of `as_dtype`
  views) is converted as it is packed (`pack`).
- Every offset is a multiple of `ALIGN` bytes, so a tensor read back is a view of the bucket
  (no copy) whatever its dtype.
- The manifest is plain JSON (no pickle): dtypes by name, checked against a fixed list when
  read, and every size checked against the bucket it claims to lie in.

torch and the standard library only: it also runs inside vLLM's workers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["ALIGN", "DTYPES", "alone", "as_dtype", "pack", "plan", "unpack"]

ALIGN = 64
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

Manifest = dict[str, Any]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """What `plan` should see of `tensor` when floating tensors travel in `dtype` (None: as
    they are): the tensor itself, or a meta tensor of its shape in `dtype` (no memory)."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return torch.empty(tensor.shape, dtype=dtype, device="meta")


def plan(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, alone_bytes: int | None = None
) -> Manifest:
    """The manifest of `tensors` (in their order) cut into buckets of `bucket_bytes` at most;
    a tensor of `alone_bytes` or more (default: `bucket_bytes`) gets a bucket of its own, which
    a sender may broadcast straight from the tensor's memory (`alone`), without packing."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    alone_at = bucket_bytes if alone_bytes is None else min(alone_bytes, bucket_bytes)
    buckets: list[dict[str, Any]] = []
    entries: list[list[Any]] = []
    offset = 0

    def close() -> None:
        nonlocal entries, offset
        if entries:
            buckets.append({"nbytes": offset, "tensors": entries})
        entries, offset = [], 0

    for name, tensor in tensors:
        if tensor.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be transferred")
        size = _nbytes(tensor)
        entry = [name, _NAMES[tensor.dtype], list(tensor.shape), 0]
        if size >= alone_at:
            close()
            buckets.append({"nbytes": size, "tensors": [entry]})
            continue
        if entries and offset + size > bucket_bytes:
            close()
        entry[3] = offset
        entries.append(entry)
        offset = _aligned(offset + size)
    close()
    return {"buckets": buckets, "total_bytes": sum(b["nbytes"] for b in buckets)}


def alone(bucket: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The bytes of a bucket that is one whole contiguous tensor, as a view of that tensor's
    own memory (nothing to pack); None for a bucket that must be packed."""
    if len(bucket["tensors"]) != 1:
        return None
    name, dtype = bucket["tensors"][0][:2]
    tensor = tensors[name].detach()
    if tensor.dtype != DTYPES[dtype]:  # it travels converted (the replica's dtype): packed
        return None
    if not tensor.is_contiguous() or tensor.dim() == 0 or _nbytes(tensor) != bucket["nbytes"]:
        return None
    return tensor.view(torch.uint8).reshape(-1)


def pack(bucket: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy the bucket's tensors from `tensors` into `out` (uint8, at least `nbytes` long;
    on any device: a GPU trainer's weights are copied into a CPU bucket here), each in the
    dtype the bucket names for it."""
    with torch.no_grad():
        for name, dtype, shape, offset in bucket["tensors"]:
            size = math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()
            view = out[offset : offset + size].view(DTYPES[dtype]).view(shape)
            view.copy_(tensors[name])  # converted to the bucket's dtype where it differs


def unpack(bucket: Mapping[str, Any], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """name → a view of `flat` for every tensor of the bucket; ValueError if the bucket's
    entries do not fit it (a manifest that does not describe these bytes)."""
    out: dict[str, torch.Tensor] = {}
    for entry in bucket["tensors"]:
        name, dtype_name, shape, offset = entry
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"{name}: unknown dtype {dtype_name!r}")
        if not (isinstance(offset, int) and offset >= 0 and offset % ALIGN == 0):
            raise ValueError(f"{name}: bad offset {offset!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{name}: bad shape {shape!r}")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + size > flat.numel():
            raise ValueError(f"{name}: {size} bytes at {offset} overrun a bucket of {flat.numel()}")
        out[name] = flat[offset : offset + size].view(dtype).view(shape)
    return out
