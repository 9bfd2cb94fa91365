"""What a model directory's `config.json` says about Mixture-of-Experts routing. No torch.

`rollout worker agent-loop` asks before it starts, to turn on
`agent_loop.llm.return_routed_experts` when the policy routes tokens (its default, None), and a
`vllm` replica serving routed experts needs the experts per layer to pack them. A model counts
as MoE when its config (or its `text_config`) names a positive number of experts
(`num_experts`, `num_local_experts` or `n_routed_experts`) and of experts per token
(`num_experts_per_tok`), as Qwen2/Qwen3-MoE, Mixtral and DeepSeek configs do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["experts_per_layer", "is_moe"]

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _experts(config: Any) -> int | None:
    if not isinstance(config, dict):
        return None
    experts = next((config[k] for k in _EXPERT_KEYS if isinstance(config.get(k), int)), 0)
    per_token = config.get("num_experts_per_tok")
    return experts if experts > 0 and isinstance(per_token, int) and per_token > 0 else None


def experts_per_layer(model_dir: str | Path) -> int | None:
    """The experts of each MoE layer of the model at `model_dir`; None if dense or unreadable."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = _experts(config)
    if found is None and isinstance(config, dict):
        found = _experts(config.get("text_config"))
    return found


def is_moe(model_dir: str | Path) -> bool:
    """True when `model_dir/config.json` describes a Mixture-of-Experts model."""
    return experts_per_layer(model_dir) is not None
