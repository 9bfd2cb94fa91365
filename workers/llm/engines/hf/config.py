"""The `hf` engine's knobs and counters, apart from the engine (reading them needs no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["EngineStats", "HFEngineConfig"]


class HFEngineConfig(BaseModel):
    """Knobs of the CPU engine."""

    threads: int = Field(default=2, ge=1, le=64, description="torch intra-op threads.")
    max_batch: int = Field(default=64, ge=1, description="Running sequences at most.")
    prefix_cache_tokens: int = Field(
        default=32768, ge=0, description="Tokens of finished sequences' KV kept for reuse."
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="Context limit; default: the model's max positions."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="The dtype the engine serves in (the trainer's fp32 by default, so its "
        "logprobs are the ones the trainer recomputes); broadcast weights travel in it.",
    )


@dataclass
class EngineStats:
    """The engine's cumulative counters, under the replica contract's metric names."""

    generated_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
