"""DAPO's soft overlong punishment: a length penalty added to the score of long responses.

With L the response length (every response token, as DAPO's `valid_response_length`),
L_max = `max_response_length` and B = `buffer_len`, the penalty is

    0                                 L ≤ L_max − B
    −(L − (L_max − B)) / B · factor   L_max − B < L ≤ L_max   (linear, reaching −factor)
    −factor                           L > L_max

so responses that run into their budget earn less than short ones of the same score, and a
policy drifting toward truncation is pushed back before every response is cut. Pure logic.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["OverlongConfig", "overlong_penalty"]


class OverlongConfig(BaseModel):
    """The overlong buffer (`buffer_len` 0: off)."""

    model_config = ConfigDict(extra="forbid")

    buffer_len: int = Field(
        default=0, ge=0, le=1 << 20, description="Tokens before the budget where the penalty ramps."
    )
    penalty_factor: float = Field(
        default=1.0, ge=0, le=100, description="The penalty at (and past) the budget."
    )
    max_response_length: int | None = Field(
        default=None,
        ge=1,
        description="The budget L_max; None: the agent loop's sampling.max_tokens (run config).",
    )

    @model_validator(mode="after")
    def _fits(self) -> OverlongConfig:
        if self.max_response_length is not None and self.buffer_len > self.max_response_length:
            raise ValueError("overlong.buffer_len must not exceed max_response_length")
        return self

    @property
    def enabled(self) -> bool:
        return self.buffer_len > 0 and self.penalty_factor > 0


def overlong_penalty(length: int, config: OverlongConfig) -> float:
    """The (non-positive) penalty of a response of `length` tokens."""
    if not config.enabled or config.max_response_length is None:
        return 0.0
    start = config.max_response_length - config.buffer_len
    if length <= start:
        return 0.0
    return -min(length - start, config.buffer_len) / config.buffer_len * config.penalty_factor
