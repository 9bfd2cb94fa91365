"""A long generation interrupted by a weight update comes back through the client whole.

The `LLMClient` sends a greedy 400-token generation to the vLLM replica; `/update_weights` to
another checkpoint lands in the middle. The client must return one generation of exactly 400
tokens spanning two versions (`min_global_steps < max_global_steps`), and its tokens must be
intact: a prefix of them has the logprobs of the old checkpoint and the rest those of the new
one, each given all tokens before it (a lost, repeated or reordered token breaks both).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.vllm.support import Replica, http, reference_logprobs

pytestmark = pytest.mark.vllm

PROMPT = [(17 * i + 1) % 900 + 20 for i in range(24)]
MAX_TOKENS = 400


def _running(replica: Replica) -> int:
    status, info = http(replica.url + "/info", timeout=10)
    return int(info.get("running", 0)) if status == 200 else 0


async def _generate_across_update(replica: Replica, new_weights: Path, version: int) -> object:
    from workers.llm.balancer import Replica as Routed
    from workers.llm.client import LLMClient
    from workers.llm.config import LLMClientConfig

    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    async with LLMClient(LLMClientConfig(), [Routed("vllm-tied", replica.url)]) as client:
        task = asyncio.create_task(client.generate("resume-1", PROMPT, params))
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(_running, replica) < 1:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # some tokens under the old weights
        assert not task.done(), "the generation finished before the update"
        await asyncio.to_thread(replica.update_weights, new_weights, version)
        return await task


def test_generation_resumes_across_a_weight_update(
    tied_replica: Replica, checkpoints: dict[str, list[Path]]
) -> None:
    old, new = checkpoints["tied"][0], checkpoints["tied"][2]
    status, health = http(tied_replica.url + "/health")
    assert status == 200, health
    tied_replica.update_weights(old, int(health["version"]) + 1)
    before = int(health["version"]) + 1
    out = asyncio.run(_generate_across_update(tied_replica, new, before + 1))

    assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
    assert (out.min_global_steps, out.max_global_steps) == (before, before + 1)
    assert out.pieces >= 2 and len(out.logprobs) == MAX_TOKENS
    ref_old = reference_logprobs(old, PROMPT, out.token_ids)
    ref_new = reference_logprobs(new, PROMPT, out.token_ids)
    matches_old = [abs(a - b) <= 1e-3 for a, b in zip(out.logprobs, ref_old, strict=True)]
    split = matches_old.index(False)  # the first token of the new version
    assert 0 < split < MAX_TOKENS
    assert all(matches_old[:split])
    tail = [abs(a - b) for a, b in zip(out.logprobs[split:], ref_new[split:], strict=True)]
    assert max(tail) <= 1e-3, f"tokens after the update do not match the new checkpoint: {tail}"
