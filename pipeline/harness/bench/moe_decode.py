"""Decode rate of the `hf` engine on a Mixture-of-Experts model, routed experts returned or not.

`decode_rate(model_dir, routed)` builds one in-process engine (prefix cache off, so repeated
calls measure the same work), warms it up, then runs `rows` seeded `ignore_eos` generations
of `max_tokens` tokens at once (one batched decode step per token) with
`return_routed_experts = routed`, and returns the generated tokens per second of that batch.
Prompts are short (`prompt_len`), so the rate is the decode steps' and the prefill's share is
small. Everything but `routed` is the same in both cases (prompts, seeds, tokens): the
difference is what recording the routing costs (`RouterTap`: keeping each layer's
`selected_experts` and handing each row its slice). `rollout bench moe` calls it in interleaved
rounds and reports the ratio; goal ≥ 0.9.

`rollout bench moe-decode --json` (`run`) is that measurement alone: `rounds` rounds, each
measuring both sides in alternating order (ABBA, so neither always runs first), on `--model`
or a freshly built `moe` preset; `ratio` is the median of the rounds' routed / plain ratios.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.harness.bench.common import paired_ratio

__all__ = ["decode_rate", "run"]


def run(
    model_dir: str | None = None,
    rounds: int = 5,
    rows: int = 8,
    max_tokens: int = 64,
    threads: int = 1,
) -> dict[str, Any]:
    """Decode tokens/s with routed experts returned vs not, `rounds` interleaved rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            from pipeline.harness.models.tiny import init_model

            model_dir = str(init_model(Path(tmp) / "moe", preset="moe", seed=0))
        routed: list[float] = []
        plain: list[float] = []
        for r in range(rounds):
            for flag in (True, False) if r % 2 == 0 else (False, True):
                rate = decode_rate(
                    model_dir, flag, rows=rows, max_tokens=max_tokens, threads=threads
                )
                (routed if flag else plain).append(rate)
    return {
        "rows": rows,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "threads": threads,
        "decode_tokens_per_s_routed": round(statistics.median(routed), 1),
        "decode_tokens_per_s_plain": round(statistics.median(plain), 1),
        "decode_tokens_per_s_routed_runs": [round(x, 1) for x in routed],
        "decode_tokens_per_s_plain_runs": [round(x, 1) for x in plain],
        **paired_ratio(routed, plain, "ratio"),
    }


def decode_rate(
    model_dir: str | Path,
    routed: bool,
    *,
    rows: int = 8,
    max_tokens: int = 64,
    prompt_len: int = 16,
    threads: int = 1,
    seed: int = 0,
) -> float:
    """Generated tokens per second of `rows` concurrent generations (module docstring)."""
    return asyncio.run(_rate(Path(model_dir), routed, rows, max_tokens, prompt_len, threads, seed))


async def _rate(
    model_dir: Path,
    routed: bool,
    rows: int,
    max_tokens: int,
    prompt_len: int,
    threads: int,
    seed: int,
) -> float:
    from workers.llm.contract import SamplingParams
    from workers.llm.engines.hf.engine import HFEngine, HFEngineConfig

    engine = HFEngine(
        model_dir, HFEngineConfig(threads=threads, max_batch=rows, prefix_cache_tokens=0)
    )
    try:
        if routed and engine.router_tap is None:
            raise ValueError(f"{model_dir} is a dense model: it routes no token")
        rng = random.Random(seed)
        prompts = [
            [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len)] for _ in range(rows)
        ]
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True)
            for i in range(rows)
        ]
        warm = params[0].model_copy(update={"max_tokens": 4})
        await engine.generate(prompts[0], warm, routed=routed)
        start = time.perf_counter()
        results = await asyncio.gather(
            *(engine.generate(p, sp, routed=routed) for p, sp in zip(prompts, params, strict=True))
        )
        seconds = time.perf_counter() - start
    finally:
        await engine.aclose()
    return sum(len(r.token_ids) for r in results) / seconds
