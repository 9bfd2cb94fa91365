"""Long generations interrupted by a weight update come back through the client whole.

The `LLMClient` sends greedy generations of half the context to the vLLM replica, several at
once (a batch makes each step slower, so the update lands well inside them); `/update_weights`
to another checkpoint follows once all six are running (a request knocked out by a failed
connection, as once seen in CI, is waited for until its retry runs) and vLLM has generated a
few tokens of each. Even one of them alone takes over ten seconds: no stall of this process,
which on two shared cores reaches several seconds, lets one finish before the update is sent.

Every generation must come back as one of exactly MAX_TOKENS tokens spanning two versions
(`min_global_steps < max_global_steps`), and its tokens must be intact: a prefix of them has
the logprobs of the old checkpoint and the rest those of the new one, each given all tokens
before it (a lost, repeated or reordered token breaks both).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.vllm.support import Replica, http, reference_logprobs

pytestmark = pytest.mark.vllm

PROMPT = [(17 * i + 1) % 900 + 20 for i in range(24)]
MAX_TOKENS = 4000  # of max_model_len CONTEXT (8192); alone about 12 s on the CPU build
POLL_S = 0.05  # each poll is a scrape of vLLM's /metrics too: not so often that it slows it
PARALLEL = 6


def _progress(replica: Replica) -> tuple[float, float]:
    """(tokens generated so far, requests running now), from the replica's /metrics."""
    status, text = http(replica.url + "/metrics", timeout=10)
    assert status == 200, text
    generated = running = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rollout_replica_generated_tokens_total":
                generated += sample.value
            elif sample.name == "rollout_replica_running_requests":
                running += sample.value
    return generated, running


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
        before, _ = await asyncio.to_thread(_progress, replica)
        tasks = [
            asyncio.create_task(client.generate(f"resume-{i}", PROMPT, params))
            for i in range(PARALLEL)
        ]
        deadline = time.monotonic() + 120
        # All six running (one knocked out and retried counts once it runs again: sent after
        # the update, it would span one version) and a few tokens of each generated.
        while True:
            generated, running = await asyncio.to_thread(_progress, replica)
            if running >= PARALLEL and generated >= before + 8 * PARALLEL:
                break
            _none_done(tasks)
            assert time.monotonic() < deadline, "vLLM did not run all six generations in 120 s"
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
