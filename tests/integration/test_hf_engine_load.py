"""The hf engine's load (`running + waiting`, what its replica reports to the balancers) counts
a request through its whole life: queued, in prefill, in the batch; and not once answered."""

from __future__ import annotations

import asyncio

from workers.llm.contract import SamplingParams
from workers.llm.engines.hf.engine import HFEngine


async def test_a_request_in_prefill_counts_and_an_answered_one_does_not(tiny_model) -> None:
    engine = HFEngine(tiny_model)
    try:
        # max_tokens=1 finishes in prefill: it never joins the batch, so without counting the
        # prefill the replica would look idle for the whole of a long prompt's forward pass
        prompt = [1, *(3 + i % 500 for i in range(1800))]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        task = asyncio.ensure_future(engine.generate(prompt, params, "long-prefill"))
        seen: set[tuple[int, int]] = set()  # (running, waiting)
        while not task.done():
            seen.add((engine.running, engine.waiting))
            await asyncio.sleep(0)
        out = await task
        assert len(out.token_ids) == 1
        assert (1, 0) in seen, seen  # out of the queue, in prefill: counted as running
        assert engine.running + engine.waiting == 0
        # in the batch, and not counted by the time its caller has the answer
        long = asyncio.ensure_future(
            engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "short")
        )
        out = await asyncio.wait_for(long, 60)
        assert len(out.token_ids) == 4 and engine.running == 0
    finally:
        await engine.aclose()
