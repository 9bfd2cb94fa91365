"""A bounded LRU of key/value caches keyed by the token prefix they cover.

The `hf` engine stores here the KV of every sequence that leaves its running batch (finished
or aborted), and looks up the longest cached prefix of every new prompt, so a later turn of
the same conversation (old prompt + old response + new tokens) prefills only the new tokens,
and a generation resumed after an abort prefills nothing but its last token.

Invariants:
- An entry's KV covers exactly its tokens, from position 0: causal attention makes the KV of
  the first m tokens valid for any sequence that starts with those m tokens, so a lookup may
  use any prefix of an entry.
- The KV is only valid for the weights that computed it: the owner must `clear()` on every
  weight update.
- The total number of cached tokens never exceeds `max_tokens`; least recently used entries
  go first. An entry that is a prefix of a newly inserted one is dropped (it adds nothing).
- An entry may hold the routed experts of its tokens (a Mixture-of-Experts model's, when the
  request that left it asked for them), (tokens, layers, top_k), the rows `RouterTap` took:
  a lookup that needs routing (`routed=True`) only uses entries that hold it, and returns the
  prefix's rows, so a cache hit returns the cached prompt tokens' routing as a prefill would.
- Not thread-safe: the engine thread is the only user.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["KV", "Hit", "PrefixCache"]

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, keys and values shaped [1, kv_heads, tokens, head_dim]."""


@dataclass(eq=False)
class _Entry:
    tokens: np.ndarray
    kv: KV
    routing: np.ndarray | None = None  # (tokens, layers, top_k) expert indices


class Hit(NamedTuple):
    """What a lookup found: the prefix length, its KV, its routing (when asked and held)."""

    length: int
    kv: KV | None
    routing: np.ndarray | None


class PrefixCache:
    """Longest-prefix lookup over recently finished sequences, bounded by tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int], limit: int, routed: bool = False) -> Hit:
        """The longest cached prefix of `tokens`, at most `limit` long, with its KV (and its
        routing, from entries that hold one, when `routed`)."""
        if not self._entries or limit <= 0:
            return Hit(0, None, None)
        query = np.asarray(tokens, dtype=np.int64)
        best_len, best_id = 0, -1
        for entry_id, entry in self._entries.items():
            n = min(len(entry.tokens), len(query), limit)
            if n <= best_len or entry.tokens[0] != query[0]:
                continue
            if routed and entry.routing is None:
                continue
            mismatch = np.flatnonzero(entry.tokens[:n] != query[:n])
            common = int(mismatch[0]) if mismatch.size else n
            if common > best_len:
                best_len, best_id = common, entry_id
        if best_id < 0:
            return Hit(0, None, None)
        self._entries.move_to_end(best_id)
        entry = self._entries[best_id]
        kv = [(k[:, :, :best_len], v[:, :, :best_len]) for k, v in entry.kv]
        routing = entry.routing[:best_len] if routed and entry.routing is not None else None
        return Hit(best_len, kv, routing)

    def insert(self, tokens: Sequence[int], kv: KV, routing: np.ndarray | None = None) -> None:
        """Keep `kv` (covering exactly `tokens`), and their `routing` if given, for later
        lookups; evicts LRU entries."""
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        for entry_id, entry in list(self._entries.items()):
            m = len(entry.tokens)
            # One entry covers another only with its routing too: routed lookups need that.
            if m <= n and np.array_equal(entry.tokens, arr[:m]):
                if routing is not None or entry.routing is None:
                    self._drop(entry_id)
            elif m > n and np.array_equal(entry.tokens[:n], arr):
                if entry.routing is not None or routing is None:
                    self._entries.move_to_end(entry_id)  # already covered by a longer entry
                    return
        while self._entries and self.cached_tokens + n > self.max_tokens:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_id] = _Entry(arr, kv, routing)
        self._next_id += 1
        self.cached_tokens += n

    def clear(self) -> None:
        self._entries.clear()
        self.cached_tokens = 0

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.cached_tokens -= len(entry.tokens)
