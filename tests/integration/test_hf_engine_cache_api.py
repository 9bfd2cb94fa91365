"""The hf engine hands its KV cache to transformers by the supported name.

transformers 5.24 renamed the forward argument `past_key_values` to `cache` (the old name
warns and goes in 5.40). Prefill, decode and a prefix-cache hit must all run without that
warning, and give the same tokens as before the rename.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings

from workers.llm.contract import SamplingParams
from workers.llm.engines.hf.engine import HFEngine


async def test_prefill_decode_and_prefix_hits_use_the_supported_cache_argument(tiny_model) -> None:
    engine = HFEngine(tiny_model)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    prompt = list(range(3, 40))
    try:
        takes_cache = "cache" in inspect.signature(engine.model.forward).parameters
        assert engine._cache_kw == ("cache" if takes_cache else "past_key_values")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first = await asyncio.wait_for(engine.generate(prompt, params, "a"), 60)
            again = await asyncio.wait_for(engine.generate(prompt, params, "b"), 60)
        deprecated = [w for w in seen if "past_key_values" in str(w.message)]
        assert not deprecated, deprecated[0].message
        assert again.token_ids == first.token_ids and len(first.token_ids) == 6
        assert engine.stats.prefix_cache_hits > 0
    finally:
        await engine.aclose()
