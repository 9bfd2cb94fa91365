"""The `hf` engine's routed experts: each request's rows of its own forwards, nobody else's.

A tiny Qwen3-MoE (4 layers, 8 experts, top-2) built in memory and saved to a temporary
directory, served by a real in-process `HFEngine`; every routing the engine returns is compared
with a transformers forward of the whole sequence with a hook on each layer's router (what the
trainer would record). Rows of different lengths share batched decode steps (left padding in
the KV), join and leave the batch at different steps, and reuse a cached prefix.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from workers.llm.contract import SamplingParams  # noqa: E402
from workers.llm.engines.exceptions import InvalidRequestError  # noqa: E402
from workers.llm.engines.hf.engine import HFEngine, HFEngineConfig  # noqa: E402

LAYERS, EXPERTS, TOP_K, VOCAB = 4, 8, 2, 128


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def tiny_moe(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.2,  # spread router logits: no near-ties for fp32 noise to flip
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _save(Qwen3MoeForCausalLM(config).eval(), path)


def reference(model_dir: Path, ids: list[int]) -> np.ndarray:
    """(positions, layers, top_k) of one full forward over `ids`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    taken: list[torch.Tensor] = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda _m, _a, out: taken.append(out[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return torch.stack(taken, 1).numpy()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("moe") / "m")


def params(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def check(moe_dir: Path, prompt: list[int], result: object) -> None:
    routed = result.routed_experts  # type: ignore[attr-defined]
    tokens = result.token_ids  # type: ignore[attr-defined]
    assert routed is not None and routed.dtype == np.uint8
    assert routed.shape == (len(prompt) + len(tokens) - 1, LAYERS, TOP_K)
    assert np.array_equal(routed, reference(moe_dir, prompt + tokens[:-1])[: len(routed)])


async def test_rows_of_a_batch_get_their_own_routing_padding_excluded(moe_dir: Path) -> None:
    engine = HFEngine(moe_dir, HFEngineConfig(threads=1, max_batch=4))
    try:
        prompts = [[5, 9, 3], [7, 1, 2, 8, 8, 4, 6, 30, 11], [40, 41, 42, 43, 44]]
        lengths = [12, 7, 20]  # rows leave at different steps; the batch is trimmed then
        routed = [True, False, True]
        first = asyncio.ensure_future(engine.generate(prompts[0], params(lengths[0], 0), "a", True))
        while engine.stats.generated_tokens < 3:  # "a" decodes alone, then the others join
            await asyncio.sleep(0.005)
        rest = [
            engine.generate(p, params(n, i), f"r{i}", r)
            for i, (p, n, r) in enumerate(zip(prompts, lengths, routed, strict=True))
            if i > 0
        ]
        results = [await first, *await asyncio.gather(*rest)]
        for prompt, n, want, result in zip(prompts, lengths, routed, results, strict=True):
            assert len(result.token_ids) == n
            if want:
                check(moe_dir, prompt, result)
            else:
                assert result.routed_experts is None
    finally:
        engine.close()


async def test_a_prefix_cache_hit_returns_the_cached_tokens_routing(moe_dir: Path) -> None:
    engine = HFEngine(moe_dir, HFEngineConfig(threads=1))
    try:
        prompt = [3, 14, 15, 92, 65]
        first = await engine.generate(prompt, params(10, 1), "t1", routed=True)
        turn2 = [*prompt, *first.token_ids, 26, 53]  # the next turn of the same conversation
        second = await engine.generate(turn2, params(6, 2), "t2", routed=True)
        assert second.cached_tokens == len(prompt) + len(first.token_ids) - 1
        check(moe_dir, turn2, second)
        assert np.array_equal(
            second.routed_experts[: len(first.routed_experts)], first.routed_experts
        )
        # An entry left by a request that asked for no routing is not used by one that does.
        other = [99, 98, 97, 96]
        plain = await engine.generate(other, params(5, 3), "p", routed=False)
        again = [*other, *plain.token_ids]
        hit = await engine.generate(again, params(3, 4), "q", routed=False)
        assert hit.cached_tokens > 0 and hit.routed_experts is None
        routed_again = await engine.generate(again, params(3, 4), "q2", routed=True)
        assert routed_again.cached_tokens == 0
        check(moe_dir, again, routed_again)
    finally:
        engine.close()


async def test_a_dense_model_refuses_routing(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    engine = HFEngine(
        _save(Qwen2ForCausalLM(config), tmp_path / "dense"), HFEngineConfig(threads=1)
    )
    try:
        assert engine.router_tap is None
        with pytest.raises(InvalidRequestError, match="dense"):
            await engine.generate([1, 2, 3], params(2, 0), routed=True)
        assert (await engine.generate([1, 2, 3], params(2, 0))).routed_experts is None
    finally:
        engine.close()


async def test_an_engine_serving_bf16_keeps_its_kv_in_bf16(moe_dir: Path) -> None:
    """`HFEngineConfig(dtype="bfloat16")`: weights and KV slabs in bf16 (a float32 slab made
    sdpa refuse the first forward), batched rows and a prefix-cache hit included; broadcast
    weights then travel in bf16 (`/health` says it)."""
    engine = HFEngine(moe_dir, HFEngineConfig(threads=1, max_batch=4, dtype="bfloat16"))
    try:
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        prompt = [5, 9, 3, 7, 1]
        runs = [engine.generate(prompt, params(6, i), f"b{i}", False) for i in range(2)]
        first, second = await asyncio.gather(*runs)
        again = await engine.generate(prompt, params(6, 0), "b2", False)  # cached prefix
        assert len(first.token_ids) == len(second.token_ids) == 6
        assert again.token_ids == first.token_ids  # the same seed, the same tokens
    finally:
        engine.close()
