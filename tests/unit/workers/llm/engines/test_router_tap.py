"""`RouterTap`: hooks on a MoE model's routers, in layer order, recording only when asked."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from workers.llm.engines.hf.router_tap import RouterTap, capture  # noqa: E402


def tiny(arch: str, experts: int = 4) -> torch.nn.Module:
    from transformers import (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_experts": experts,
        "num_experts_per_tok": 2,
    }
    torch.manual_seed(0)
    if arch == "qwen3":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, **common)).eval()
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(shared_expert_intermediate_size=16, **common)).eval()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_rows_are_positions_in_layer_order_and_only_captured_when_on(arch: str) -> None:
    model = tiny(arch)
    tap = RouterTap.attach(model)
    assert tap is not None and (tap.layers, tap.top_k, tap.num_experts) == (3, 2, 4)
    taken: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: taken.append(out[2]))
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])  # 2 rows x 5 positions
    with torch.no_grad(), capture(tap, True):
        model(input_ids=ids)
    rows = tap.take()
    assert rows.shape == (10, 3, 2) and str(rows.dtype) == "uint8"
    assert (rows == torch.stack(taken, 1).numpy()).all()  # row-major (row, position)
    with torch.no_grad(), capture(tap, False):
        model(input_ids=ids)
    with pytest.raises(RuntimeError, match="did not route"):
        tap.take()  # nothing kept when off
    assert capture(None, True) is not None  # a dense model: nothing to tap


def test_more_than_256_experts_pack_as_int16() -> None:
    model = tiny("qwen3", experts=300)
    tap = RouterTap.attach(model)
    assert tap is not None
    with torch.no_grad(), capture(tap, True):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    rows = tap.take()
    assert str(rows.dtype) == "int16" and rows.shape == (3, 3, 2) and int(rows.max()) < 300
