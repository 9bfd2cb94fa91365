"""The `hf` engine's prefix KV cache and sampler: pure logic on small tensors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from workers.llm.contract import SamplingParams  # noqa: E402
from workers.llm.engines.hf.prefix_cache import PrefixCache  # noqa: E402
from workers.llm.engines.hf.sampling import sample_batch  # noqa: E402


def kv_for(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fake one-layer KV whose values encode the token at each position."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t.clone(), -t.clone())]


def test_longest_prefix_wins_and_is_sliced() -> None:
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.insert([1, 2, 9, 9, 9], kv_for([1, 2, 9, 9, 9]))
    n, kv, _ = cache.lookup([1, 2, 9, 9, 7, 7], limit=5)
    assert n == 4 and kv is not None
    assert kv[0][0].flatten().tolist() == [1, 2, 9, 9]
    assert cache.lookup([5, 1, 2], limit=2) == (0, None, None)
    n, _, _ = cache.lookup([1, 2, 3, 4], limit=2)  # never past the caller's limit
    assert n == 2


def test_prefix_entries_are_replaced_and_lru_evicts_by_tokens() -> None:
    cache = PrefixCache(max_tokens=8)
    cache.insert([1, 2], kv_for([1, 2]))
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))  # supersedes [1, 2]
    assert len(cache) == 1 and cache.cached_tokens == 4
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))  # already covered: nothing added
    assert len(cache) == 1
    cache.insert([7, 8, 9], kv_for([7, 8, 9]))
    cache.lookup([1, 2, 3, 4, 5], limit=4)  # touch [1..4]: [7, 8, 9] is now the LRU
    cache.insert([5, 6, 7], kv_for([5, 6, 7]))
    assert cache.cached_tokens <= 8
    assert cache.lookup([7, 8, 9, 1], limit=3) == (0, None, None)
    assert cache.lookup([1, 2, 3, 4, 0], limit=4)[0] == 4
    cache.clear()
    assert len(cache) == 0 and cache.cached_tokens == 0


def routing_for(tokens: list[int]) -> np.ndarray:
    """Fake routing (tokens, 2 layers, top-2) whose rows encode the token at each position."""
    t = np.asarray(tokens, dtype=np.uint8)
    return np.stack([np.stack([t, t + 1], -1), np.stack([t + 2, t + 3], -1)], 1)


def test_routed_lookups_use_only_entries_with_routing_and_slice_it() -> None:
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]))  # left by a request without routing
    cache.insert([1, 2, 3], kv_for([1, 2, 3]), routing_for([1, 2, 3]))
    hit = cache.lookup([1, 2, 3, 4, 5, 6], limit=5, routed=True)
    assert hit.length == 3 and hit.routing is not None  # the longer entry has none to give
    assert np.array_equal(hit.routing, routing_for([1, 2, 3]))
    assert cache.lookup([1, 2, 3, 4, 5, 6], limit=5).length == 5  # unrouted: the longest
    assert cache.lookup([1, 2, 3, 4, 5, 6], limit=5).routing is None
    hit = cache.lookup([1, 2, 9], limit=2, routed=True)
    assert hit.length == 2 and np.array_equal(hit.routing, routing_for([1, 2]))
    # A routed entry is never replaced by an unrouted one that covers it, nor the reverse
    # when the new one brings routing: routed lookups still find their prefix.
    cache.insert([1, 2, 3, 4, 5, 6, 7], kv_for([1, 2, 3, 4, 5, 6, 7]))
    assert cache.lookup([1, 2, 3, 8], limit=3, routed=True).length == 3
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]), routing_for([1, 2, 3, 4]))
    hit = cache.lookup([1, 2, 3, 4, 8], limit=4, routed=True)
    assert hit.length == 4 and np.array_equal(hit.routing, routing_for([1, 2, 3, 4]))


def test_sampler_logprobs_greedy_truncation_and_seeds() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=0.5, top_k=1)
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)]
    tokens, lps = sample_batch(logits, [greedy, hot], gens)
    assert tokens == [0, 1]
    assert lps[0] == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())
    assert lps[1] == pytest.approx(torch.log_softmax(logits[1] / 0.5, -1)[1].item())
    nucleus = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    for i in range(20):  # token 1 alone holds > 50% of row 1's mass
        tok, _ = sample_batch(logits[1:], [nucleus], [torch.Generator().manual_seed(i)])
        assert tok == [1]
    free = SamplingParams(temperature=1.0)
    a = sample_batch(logits.repeat(8, 1), [free] * 16, [torch.Generator().manual_seed(5)] * 16)
    b = sample_batch(logits.repeat(8, 1), [free] * 16, [torch.Generator().manual_seed(5)] * 16)
    assert a == b
