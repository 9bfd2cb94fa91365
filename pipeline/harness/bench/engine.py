"""Throughput of the `hf` engine: the same requests run concurrently vs one at a time.

`run(model_dir, concurrency, max_tokens, prompt_len)` builds one in-process engine, sends
`concurrency` distinct prompts (seeded, `ignore_eos`, so both passes generate exactly the same
number of tokens) one after another and all at once, twice each in ABBA order, and reports the
best generated tokens per second of each mode and their ratio. The prefix cache is disabled
so the second pass does not profit from the first. Continuous batching should give `ratio` ≥ 4
at concurrency 16 on CPU.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path
from typing import Any

__all__ = ["run"]

logger = logging.getLogger("rollout.llm.replica.bench")


def run(
    model_dir: str | Path,
    concurrency: int = 16,
    max_tokens: int = 64,
    prompt_len: int = 64,
    threads: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure serial vs concurrent generation; returns a dict of figures (tokens/s, ratio)."""
    return asyncio.run(_run(Path(model_dir), concurrency, max_tokens, prompt_len, threads, seed))


async def _run(
    model_dir: Path, concurrency: int, max_tokens: int, prompt_len: int, threads: int, seed: int
) -> dict[str, Any]:
    from workers.llm.contract import SamplingParams
    from workers.llm.engines.hf.engine import HFEngine, HFEngineConfig

    engine = HFEngine(model_dir, HFEngineConfig(threads=threads, prefix_cache_tokens=0))
    try:
        rng = random.Random(seed)
        vocab = engine.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True)
            for i in range(concurrency)
        ]
        await engine.generate(prompts[0], params[0].model_copy(update={"max_tokens": 4}))

        async def serial_pass() -> tuple[float, list[Any]]:
            start = time.perf_counter()
            out = [await engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
            return time.perf_counter() - start, out

        async def concurrent_pass() -> tuple[float, list[Any]]:
            start = time.perf_counter()
            out = await asyncio.gather(
                *(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True))
            )
            return time.perf_counter() - start, list(out)

        # ABBA order, best of two each: load from other processes on a shared machine hits
        # both modes alike instead of whichever happened to run first.
        s1, serial = await serial_pass()
        c1, concurrent = await concurrent_pass()
        c2, _ = await concurrent_pass()
        s2, _ = await serial_pass()
        serial_s, concurrent_s = min(s1, s2), min(c1, c2)
    finally:
        await engine.aclose()

    serial_tokens = sum(len(r.token_ids) for r in serial)
    concurrent_tokens = sum(len(r.token_ids) for r in concurrent)
    same = sum(a.token_ids == b.token_ids for a, b in zip(serial, concurrent, strict=True))
    result = {
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "prompt_len": prompt_len,
        "threads": threads,
        "serial_tokens": serial_tokens,
        "serial_seconds": round(serial_s, 3),
        "serial_tokens_per_s": round(serial_tokens / serial_s, 1),
        "concurrent_tokens": concurrent_tokens,
        "concurrent_seconds": round(concurrent_s, 3),
        "concurrent_tokens_per_s": round(concurrent_tokens / concurrent_s, 1),
        "ratio": round((concurrent_tokens / concurrent_s) / (serial_tokens / serial_s), 2),
        "identical_outputs": same,
    }
    logger.info("bench %s", result)
    return result
