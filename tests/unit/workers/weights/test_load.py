"""Loading checkpoints into a live model: a MoE checkpoint in the hub's per-expert layout is
stacked into transformers 5's 3-d expert parameters (what `save_pretrained` writes, what the
trainer checkpoints and what `/update_weights` then loads)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from workers.weights import load as weights  # noqa: E402
from workers.weights.exceptions import WeightLoadError  # noqa: E402


def tiny_moe(seed: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config).eval()


def test_per_expert_checkpoints_load_into_stacked_experts(tmp_path: Path) -> None:
    live, other = tiny_moe(0), tiny_moe(1)
    other.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    on_disk = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk  # the hub's layout
    assert "model.layers.0.mlp.experts.gate_up_proj" in live.state_dict()  # the model's
    targets = weights.targets(live)
    weights.copy_into(targets, weights.read_checkpoint(tmp_path / "ckpt", targets))
    want = other.state_dict()
    assert all(torch.equal(t, want[name]) for name, t in live.state_dict().items())
    ids = torch.tensor([[1, 5, 9, 30]])
    assert torch.equal(live(input_ids=ids).logits, other(input_ids=ids).logits)


def test_a_checkpoint_missing_an_expert_is_refused_untouched(tmp_path: Path) -> None:
    live = tiny_moe(0)
    tiny_moe(1).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    file = tmp_path / "ckpt" / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.1.mlp.experts.2.gate_proj.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(
        WeightLoadError, match=r"layers\.1\.mlp\.experts: .*gate_proj of experts \[0, 1, 3\]"
    ):
        weights.read_checkpoint(tmp_path / "ckpt", weights.targets(live))
