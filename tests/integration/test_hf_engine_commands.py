"""The hf engine's command queue: a command whose caller gave up before the engine thread
reached it is skipped, and the engine lives on (it used to die on the cancelled future,
leaving the replica up but answering nothing — found by the chaos suite)."""

from __future__ import annotations

import asyncio

from workers.llm.contract import SamplingParams
from workers.llm.engines.hf.engine import HFEngine


async def test_a_cancelled_command_is_skipped_and_the_engine_keeps_serving(tiny_model) -> None:
    engine = HFEngine(tiny_model)
    try:
        ran: list[str] = []
        with engine._cv:  # the engine thread cannot take commands while we hold its lock
            gave_up = engine._submit(lambda: ran.append("cancelled"))
            assert gave_up.cancel()
            kept = engine._submit(lambda: ran.append("kept") or "ok")
        assert await asyncio.wait_for(asyncio.wrap_future(kept), 30) == "ok"
        assert ran == ["kept"]
        out = await asyncio.wait_for(
            engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "r1"), 60
        )
        assert len(out.token_ids) == 4
    finally:
        await engine.aclose()
