"""Ragged KV caches for continuous batching with a transformers model.

`BatchKV` holds the keys/values of every running sequence in one left-padded buffer per
layer, shaped [rows, kv_heads, capacity, head_dim]. A decode step feeds one token per row with
`attention_mask()` (0 over each row's left padding) and `position_ids()` (each row's own next
position), so a row's logits do not depend on what else is in the batch. Rows join (`add`,
after their own prefill) and leave (`keep`) between steps.

Invariants:
- All rows share the length `length`; row i's real tokens occupy `[pad[i], length)`.
- Padding holds zeros (never uninitialised memory: a masked NaN still poisons attention).
- After `keep`, at least one row has no padding, so `length` is the longest row's length.
- The buffers have spare capacity; a step writes its new column in place instead of
  concatenating, so a step costs O(rows), not O(rows × length), in copies.

A cache goes into the model's forward under the name `cache_kwarg(model)` returns: `cache`
where the model takes it (transformers >= 5.24, which deprecates `past_key_values` and will
remove it in 5.40), else `past_key_values` (older releases).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from workers.llm.engines.hf.prefix_cache import KV

__all__ = ["BatchKV", "SlabLayer", "StepCache", "cache_kwarg", "single_cache"]
_HEADROOM = 128


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the forward argument that takes a KV cache in this transformers release."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class SlabLayer(DynamicLayer):
    """A DynamicLayer over a preallocated buffer: `update` writes in place, grows by doubling."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.kbuf, self.vbuf, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._views()

    @classmethod
    def empty(
        cls, rows: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype
    ) -> SlabLayer:
        shape = (rows, heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), 0)

    def _views(self) -> None:
        self.keys = self.kbuf[:, :, : self.length]
        self.values = self.vbuf[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.kbuf.shape[2]:
            capacity = max(2 * self.kbuf.shape[2], end + _HEADROOM)
            self.kbuf = _regrow(self.kbuf, self.length, capacity)
            self.vbuf = _regrow(self.vbuf, self.length, capacity)
        self.kbuf[:, :, self.length : end] = key_states
        self.vbuf[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def _regrow(buf: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    out = buf.new_zeros((buf.shape[0], buf.shape[1], capacity, buf.shape[3]))
    out[:, :, :length] = buf[:, :, :length]
    return out


class StepCache(DynamicCache):
    """A DynamicCache over existing layers (no copy on construction)."""

    def __init__(self, layers: list[SlabLayer]) -> None:
        Cache.__init__(self, layers=list(layers))


def single_cache(
    prefix: KV | None,
    n_layers: int,
    heads: int,
    head_dim: int,
    new: int,
    dtype: torch.dtype = torch.float32,
) -> StepCache:
    """A one-row cache holding `prefix` (or nothing), with room for `new` more tokens, in the
    model's `dtype`."""
    layers: list[SlabLayer] = []
    for i in range(n_layers):
        have = 0 if prefix is None else prefix[i][0].shape[2]
        layer = SlabLayer.empty(1, heads, head_dim, have + new, dtype)
        if prefix is not None:
            layer.update(prefix[i][0], prefix[i][1])
        layers.append(layer)
    return StepCache(layers)


class BatchKV:
    """The running batch's KV: rows join after their prefill and leave when they finish."""

    def __init__(self, n_layers: int, heads: int, head_dim: int) -> None:
        self.n_layers, self.heads, self.head_dim = n_layers, heads, head_dim
        self.layers: list[SlabLayer] = []
        self.pad = torch.zeros(0, dtype=torch.long)
        self.length = 0

    @property
    def rows(self) -> int:
        return int(self.pad.shape[0])

    def add(self, kvs: list[KV]) -> None:
        """Append one row per KV (each [1, heads, n_i, head_dim] per layer), left-padded."""
        if not kvs:
            return
        lens = [kv[0][0].shape[2] for kv in kvs]
        length = max([self.length, *lens])
        old_rows, rows = self.rows, self.rows + len(kvs)
        shift = length - self.length
        layers: list[SlabLayer] = []
        for li in range(self.n_layers):
            bufs = []
            for which in (0, 1):
                dtype = kvs[0][li][which].dtype  # the model's (bf16 for a bf16 engine)
                buf = torch.zeros(rows, self.heads, length + _HEADROOM, self.head_dim, dtype=dtype)
                if old_rows:
                    old = self.layers[li].kbuf if which == 0 else self.layers[li].vbuf
                    buf[:old_rows, :, shift:length] = old[:, :, : self.length]
                for j, kv in enumerate(kvs):
                    buf[old_rows + j, :, length - lens[j] : length] = kv[li][which][0]
                bufs.append(buf)
            layers.append(SlabLayer(bufs[0], bufs[1], length))
        self.layers = layers
        new_pad = torch.tensor([length - n for n in lens], dtype=torch.long)
        self.pad = torch.cat([self.pad + shift, new_pad])
        self.length = length

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows (in this order) and drop padding columns no row needs."""
        if not indices:
            self.layers, self.pad, self.length = [], torch.zeros(0, dtype=torch.long), 0
            return
        index = torch.tensor(indices, dtype=torch.long)
        pad = self.pad[index]
        trim = int(pad.min())
        length = self.length - trim
        layers: list[SlabLayer] = []
        for layer in self.layers:
            bufs = []
            for old in (layer.kbuf, layer.vbuf):
                buf = old.new_zeros((len(indices), self.heads, length + _HEADROOM, self.head_dim))
                buf[:, :, :length] = old[index, :, trim : self.length]
                bufs.append(buf)
            layers.append(SlabLayer(bufs[0], bufs[1], length))
        self.layers, self.pad, self.length = layers, pad - trim, length

    def row_kv(self, i: int) -> KV:
        """A copy of row i's KV without its padding ([1, heads, n, head_dim] per layer)."""
        start = int(self.pad[i])
        return [
            (
                layer.kbuf[i : i + 1, :, start : self.length].clone(),
                layer.vbuf[i : i + 1, :, start : self.length].clone(),
            )
            for layer in self.layers
        ]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask [B, length+1], position_ids [B, 1]) for one decode step."""
        cols = torch.arange(self.length + 1)
        mask = (cols[None, :] >= self.pad[:, None]).long()
        positions = (self.length - self.pad)[:, None]
        return mask, positions

    def cache(self) -> StepCache:
        return StepCache(self.layers)

    def advanced(self) -> None:
        """Record that a step appended one column to every layer."""
        self.length = self.layers[0].length
