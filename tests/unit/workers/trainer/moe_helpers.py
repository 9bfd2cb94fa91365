"""Tiny MoE policies and routing recorded by real forwards, for the router-replay tests.

`moe_model(seed)` is a 4-layer Qwen3-MoE (8 experts, top-2) built in memory; `perturbed(model)`
is another checkpoint of it (every weight moved by seeded noise), so routing recorded under
one and trained under the other disagrees on a share of rows. `record(model, ids)` routes a
sequence through the model's own forward and reads the experts off hooks on the routers:
what an engine serving those weights records. `make_batch` collates samples that carry it.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from schemas.events import ExtraFields, ScoredTrajectory
from schemas.routing import RoutedExperts
from workers.trainer.batching import TrajectoryBatch, collate

LAYERS, EXPERTS, TOP_K, VOCAB = 4, 8, 2, 96


def moe_model(seed: int = 0, *, arch: str = "qwen3", norm_topk_prob: bool = True) -> Any:
    """A tiny MoE causal LM in fp32, eval mode, every layer MoE; `arch` one of qwen3, qwen2,
    olmoe, mixtral (Mixtral always renormalises its top-k weights)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_experts_per_tok": TOP_K,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        # Spread router logits: a zero-ish router ties experts and any noise flips them.
        "initializer_range": 0.2,
    }
    routed = {"num_experts": EXPERTS, "norm_topk_prob": norm_topk_prob}
    qwen = {**routed, "moe_intermediate_size": 32, "decoder_sparse_step": 1}
    extra: dict[str, dict[str, Any]] = {
        "qwen3": {**qwen, "head_dim": 16},
        "qwen2": {**qwen, "shared_expert_intermediate_size": 32},
        "olmoe": routed,
        "mixtral": {"num_local_experts": EXPERTS},
    }
    names = {"qwen3": "Qwen3Moe", "qwen2": "Qwen2Moe", "olmoe": "Olmoe", "mixtral": "Mixtral"}
    config = getattr(transformers, f"{names[arch]}Config")(**common, **extra[arch])
    cls = getattr(transformers, f"{names[arch]}ForCausalLM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
    return model.eval()


def perturbed(model: Any, seed: int = 1, scale: float = 0.05) -> Any:
    """Checkpoint "B": a copy of `model` with seeded noise on every weight."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return other


def routers(model: Any) -> list[Any]:
    return [layer.mlp.gate for layer in model.model.layers]


def record(model: Any, ids: list[int]) -> np.ndarray:
    """(len(ids), layers, top_k): the experts `model`'s own forward routes `ids` through."""
    seen: list[torch.Tensor] = []
    handles = [
        r.register_forward_hook(lambda m, a, out: seen.append(out[2].detach()))
        for r in routers(model)
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(seen, dim=1).numpy()


def routed(model: Any, ids: list[int], tokens: int | None = None) -> RoutedExperts:
    """`record` as the wire type, its first `tokens` positions (default: all but the last)."""
    array = record(model, ids)
    keep = len(ids) - 1 if tokens is None else tokens
    return RoutedExperts.from_array(array[:keep], num_experts=EXPERTS)


def sample(
    i: int, prompt: list[int], response: list[int], routing: RoutedExperts | None = None
) -> ScoredTrajectory:
    """Sample `i` (groups of two) with the rollout's routing `routing`."""
    return ScoredTrajectory(
        uid=f"u{i // 2}",
        trajectory_id=f"u{i // 2}/{i}",
        sample_index=i,
        attempt_id="a",
        data_source="test",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=[1] * len(response),
        response_logprobs=[-2.0] * len(response),
        num_turns=2,
        reward_score=0.0,
        extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
        routed_experts=routing,
    )


def sequences(count: int = 4, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) pairs of varied lengths (left padding in a batch)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt = rng.integers(1, VOCAB, size=5 + 2 * i).tolist()
        response = rng.integers(1, VOCAB, size=9 - i).tolist()
        out.append((prompt, response))
    return out


def make_batch(
    pairs: list[tuple[list[int], list[int]]], routing: list[RoutedExperts | None]
) -> TrajectoryBatch:
    """The trainer's batch of `pairs` (advantages 1, -1, 0.5, -0.5) with each sample's routing."""
    samples = [sample(i, p, r, routing[i]) for i, (p, r) in enumerate(pairs)]
    return collate(samples, [1.0, -1.0, 0.5, -0.5][: len(samples)])
