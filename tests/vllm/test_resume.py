"""Long generations interrupted by a weight update come back through the client whole.

The `LLMClient` sends greedy generations that fill most of the context to the vLLM replica,
several at once (a batch makes each step slower, so the update lands well inside them);
`/update_weights` to another checkpoint follows as soon as vLLM has generated a few tokens of
each. They are long enough that even one of them alone (its siblings knocked out by a failed
connection and waiting to be retried, as once seen in CI) takes over ten seconds: no stall of
this process, which on two shared cores reaches several seconds, lets one finish before the
update is sent. Every generation must come back as one of exactly MAX_TOKENS tokens spanning two
versions (`min_global_steps < max_global_steps`), and its tokens must be intact: a prefix of
them has the logprobs of the old checkpoint and the rest those of the new one, each given all
tokens before it (a lost, repeated or reordered token breaks both).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.vllm.support import Replica, http, reference_logprobs

pytestmark = pytest.mark.vllm

PROMPT = [(17 * i + 1) % 900 + 20 for i in range(24)]
MAX_TOKENS = 4000  # of max_model_len CONTEXT (8192); alone about 12 s on the CPU build
POLL_S = 0.05  # each poll is a scrape of vLLM's /metrics too: not so often that it slows it
PARALLEL = 6


def _generated(replica: Replica) -> float:
    status, text = http(replica.url + "/metrics", timeout=10)
    assert status == 200, text
    name = "rollout_replica_generated_tokens_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _none_done(tasks: list[asyncio.Task]) -> None:
    """Fail, with its own error when it raised one, if a generation ended before the update."""
    for task in tasks:
        if task.done():
            out = task.result()  # raises the generation's own error
            raise AssertionError(f"a generation finished before the update: {out!r:.300}")


async def _generate_across_update(replica: Replica, new_weights: Path, version: int) -> list:
    from workers.llm.balancer import Replica as Routed
    from workers.llm.client import LLMClient
    from workers.llm.config import LLMClientConfig

    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    # Health probes that time out on a loaded machine must not take the only replica out of
    # routing: this test is about the resume, not about health checks.
    config = LLMClientConfig(health_timeout_s=30.0, health_failures=100, no_replica_wait_s=300.0)
    async with LLMClient(config, [Routed("vllm-tied", replica.url)]) as client:
        before = await asyncio.to_thread(_generated, replica)
        tasks = [
            asyncio.create_task(client.generate(f"resume-{i}", PROMPT, params))
            for i in range(PARALLEL)
        ]
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(_generated, replica) < before + 8 * PARALLEL:
            _none_done(tasks)
            assert time.monotonic() < deadline, "vLLM generated too few tokens in 120 s"
            await asyncio.sleep(POLL_S)
        _none_done(tasks)
        await asyncio.to_thread(replica.update_weights, new_weights, version)
        return list(await asyncio.gather(*tasks))


def test_generations_resume_across_a_weight_update(
    tied_replica: Replica, checkpoints: dict[str, list[Path]]
) -> None:
    old, new = checkpoints["tied"][0], checkpoints["tied"][2]
    status, health = http(tied_replica.url + "/health")
    assert status == 200, health
    before = int(health["version"]) + 1
    tied_replica.update_weights(old, before)
    outs = asyncio.run(_generate_across_update(tied_replica, new, before + 1))

    for out in outs:
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
