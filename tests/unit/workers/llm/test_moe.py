"""Which model directories hold a Mixture-of-Experts model (from config.json alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.llm.moe import experts_per_layer, is_moe


@pytest.mark.parametrize(
    ("config", "experts"),
    [
        ({"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts_per_tok": 2}, 8),
        ({"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4}, 60),
        ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8}, 256),
        ({"text_config": {"num_experts": 128, "num_experts_per_tok": 8}}, 128),
        ({"model_type": "qwen2", "hidden_size": 128}, None),
        ({"num_experts": 8}, None),  # experts but no routing width: not a router
        ({"num_experts": 0, "num_experts_per_tok": 2}, None),
    ],
)
def test_experts_per_layer_from_config(tmp_path: Path, config: dict, experts: int | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert experts_per_layer(tmp_path) == experts
    assert is_moe(tmp_path) is (experts is not None)


def test_no_or_broken_config_is_not_moe(tmp_path: Path) -> None:
    assert not is_moe(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert not is_moe(tmp_path)
