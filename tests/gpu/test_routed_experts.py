"""Routed experts from a live replica serving a Mixture-of-Experts model (the `moe` preset).

Run by infra/gpu_check.sh (marker `gpu`) against the replica it starts on the preset: on a GPU,
`rollout replica serve --backend vllm --routed-experts` (vLLM's model runner V2, which the CPU
build lacks); with BACKEND=hf, the hf engine. Each routing is compared with a transformers
forward (CPU, fp32) of the same weights with a hook on every router: the share of (position,
layer) rows whose experts agree must be at least MIN_AGREEMENT (the figure is in the message;
the hf engine agrees on all of them, a GPU's fp32 kernels may flip a near-tie).

Environment:
    ROLLOUT_REPLICA_URL           the replica (tests skip without it)
    ROLLOUT_MODEL_PATH            the `moe` checkpoint it serves (version `/health` reports)
    ROLLOUT_UPDATE_WEIGHTS_PATH   another `moe` checkpoint (other seed) for the resume test
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

URL = os.environ.get("ROLLOUT_REPLICA_URL", "")
MODEL = os.environ.get("ROLLOUT_MODEL_PATH", "")
OTHER = os.environ.get("ROLLOUT_UPDATE_WEIGHTS_PATH", "")
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(48)]  # 3 full 16-token KV blocks: cacheable
MIN_AGREEMENT = 0.99
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _replica() -> None:
    if not (URL and MODEL and OTHER):
        pytest.skip("set ROLLOUT_REPLICA_URL, ROLLOUT_MODEL_PATH, ROLLOUT_UPDATE_WEIGHTS_PATH")


def call(method: str, path: str, body: Any = None, timeout: float = 300.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        URL + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def complete(**kw: Any) -> Any:
    from workers.llm.contract import CompletionResponse

    status, body = call("POST", "/v1/completions", {"prompt": PROMPT} | kw)
    assert status == 200, body
    return CompletionResponse.model_validate(body).choices[0]


def reference(model_dir: str, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logprob of each next token, routing (positions, layers, top_k)) of one CPU forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    taken: list[torch.Tensor] = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda _m, _a, out: taken.append(out[2]))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logprobs.numpy(), torch.stack(taken, 1).numpy()


def agreement(got: np.ndarray, want: np.ndarray) -> float:
    """Share of (position, layer) rows with the same experts (as sets: order may differ)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((np.sort(got, -1) == np.sort(want, -1)).all(-1).mean()) if got.size else 1.0


def test_routing_of_prompt_and_tokens_matches_the_served_weights() -> None:
    choice = complete(max_tokens=32, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    routed = choice.routed_experts
    assert routed is not None and (routed.layers, routed.top_k, routed.num_experts) == (4, 2, 8)
    assert routed.tokens == len(PROMPT) + len(choice.token_ids) - 1  # the last is never fed
    _, want = reference(MODEL, PROMPT + choice.token_ids)
    share = agreement(routed.as_array(), want[: routed.tokens])
    assert share >= MIN_AGREEMENT, f"routing agrees with the served weights on {share:.4f}"
    # Asked again: the prompt's KV is cached now, and so is its routing.
    again = complete(max_tokens=4, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    assert again.routed_experts is not None
    head = len(PROMPT) - 1
    share = agreement(again.routed_experts.as_array()[:head], routed.as_array()[:head])
    assert share >= MIN_AGREEMENT, f"the prompt routed again agrees on {share:.4f}"
    plain = complete(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert plain.routed_experts is None  # not asked: not sent


def _generated() -> float:
    with urllib.request.urlopen(URL + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    name = "rollout_replica_generated_tokens_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _across_update(version: int) -> Any:
    from workers.llm.balancer import Replica
    from workers.llm.client import LLMClient
    from workers.llm.config import LLMClientConfig

    _, info = call("GET", "/info")
    budget = max(64, int(info.get("max_model_len") or 2048) - len(PROMPT) - 8)
    params = {"max_tokens": budget, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    config = LLMClientConfig(health_timeout_s=30.0, health_failures=100, return_routed_experts=True)
    async with LLMClient(config, [Replica("moe", URL)]) as client:
        before = await asyncio.to_thread(_generated)
        task = asyncio.create_task(client.generate("moe-resume", PROMPT, params))
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(_generated) < before + 16:
            assert not task.done(), f"finished before the update: {task.result()!r:.200}"
            assert time.monotonic() < deadline, "the replica generated too few tokens in 120 s"
            await asyncio.sleep(0.01)
        assert not task.done(), "the generation finished before the update"
        status, body = await asyncio.to_thread(
            call, "POST", "/update_weights", {"path": OTHER, "version": version + 1}
        )
        assert status == 200, body
        return await task


def test_a_generation_resumed_across_a_weight_update_keeps_the_old_routing() -> None:
    status, health = call("GET", "/health")
    assert status == 200, health
    version = int(health["version"])
    try:
        out = asyncio.run(_across_update(version))
    finally:
        status, body = call("POST", "/update_weights", {"path": MODEL, "version": version + 2})
        assert status == 200, body  # the served weights are the preset's again
    assert out.pieces >= 2 and (out.min_global_steps, out.max_global_steps) == (
        version,
        version + 1,
    )
    seq = PROMPT + out.token_ids
    lp_old, routed_old = reference(MODEL, seq)
    lp_new, routed_new = reference(OTHER, seq)
    at = slice(len(PROMPT) - 1, None)
    old_ok = np.abs(np.asarray(out.logprobs) - lp_old[at]) <= LOGPROB_TOL
    split = int(np.argmin(old_ok))  # the first token the new weights sampled
    assert 0 < split < len(out.token_ids) and old_ok[:split].all()
    assert (np.abs(np.asarray(out.logprobs)[split:] - lp_new[at][split:]) <= LOGPROB_TOL).all()
    routed = out.routed_experts
    assert routed is not None and routed.tokens == len(seq) - 1
    got, boundary = routed.as_array(), len(PROMPT) + split - 1
    old_share = agreement(got[:boundary], routed_old[:boundary])
    new_share = agreement(got[boundary:], routed_new[boundary : len(seq) - 1])
    assert min(old_share, new_share) >= MIN_AGREEMENT, (old_share, new_share)
    assert agreement(routed_old[:boundary], routed_new[:boundary]) < 0.9  # they differ
