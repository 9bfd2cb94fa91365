"""Routed experts: which experts of a Mixture-of-Experts policy each token went through.

`RoutedExperts` is a (tokens, layers, top_k) array of expert indices, one row per token of a
sequence, in sequence order, layers in the model's MoE-layer order. Row `i` is the routing of the
token at position `i` of `prompt_ids + response_ids` when the engine fed it through the model.
A sequence's routing may be shorter than the sequence: the last sampled token is never fed (its
routing would only shape the logits after the end), and a trainer routes the positions past
`tokens` with its own router.

On the wire it is packed like the other arrays (base64 of little-endian bytes): `u1` while the
model has at most 256 experts, else `<i2`. Dense models carry `None` and pay nothing.

History is append-only: when a generation resumes after an abort, or a conversation takes its
next turn, the tokens already recorded keep the routing of the weights that produced them, and
only positions past the end are taken from the newer request (`extended_by`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from schemas.arrays import pack, unpack

__all__ = ["RoutedExperts", "routing_dtype"]

MAX_EXPERTS = 32767


def routing_dtype(num_experts: int) -> str:
    """The packed dtype for a model with `num_experts` experts per layer."""
    return "u1" if num_experts <= 256 else "<i2"


class RoutedExperts(BaseModel):
    """Expert indices of a sequence's tokens: `as_array()` has shape (tokens, layers, top_k)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)

    layers: int = Field(ge=1, description="MoE layers of the model.")
    top_k: int = Field(ge=1, description="Experts each token is routed to per layer.")
    num_experts: int = Field(ge=1, le=MAX_EXPERTS, description="Experts per layer.")
    experts: np.ndarray = Field(
        description="Flat expert indices, row-major (tokens, layers, top_k); base64 on the wire."
    )

    @model_validator(mode="before")
    @classmethod
    def _unpack(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "experts" not in data:
            return data
        num_experts = data.get("num_experts")
        if not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
            return data  # the field check reports it
        dtype = np.dtype(routing_dtype(num_experts))
        value = data["experts"]
        if isinstance(value, str | bytes):
            array = unpack(value, dtype)
        else:
            array = np.asarray(value)
            if array.dtype.kind == "f":
                raise ValueError("routed experts must be integers")
            array = np.ascontiguousarray(array.reshape(-1), dtype=dtype)
        return {**data, "experts": array}

    @model_validator(mode="after")
    def _shape(self) -> RoutedExperts:
        row = self.layers * self.top_k
        if self.experts.ndim != 1 or len(self.experts) % row:
            raise ValueError(
                f"routed experts hold {len(self.experts)} indices, "
                f"not a multiple of layers × top_k = {row}"
            )
        if len(self.experts) and int(self.experts.max()) >= self.num_experts:
            raise ValueError(f"an expert index is ≥ num_experts ({self.num_experts})")
        return self

    @field_serializer("experts", when_used="json")
    def _pack(self, experts: np.ndarray) -> str:
        return pack(experts, routing_dtype(self.num_experts))

    @property
    def tokens(self) -> int:
        """Positions recorded."""
        return len(self.experts) // (self.layers * self.top_k)

    def as_array(self) -> np.ndarray:
        """A read-only (tokens, layers, top_k) view."""
        view = self.experts.reshape(self.tokens, self.layers, self.top_k)
        view.flags.writeable = False
        return view

    @classmethod
    def from_array(cls, array: Any, num_experts: int) -> RoutedExperts:
        """From a (tokens, layers, top_k) array of expert indices."""
        array = np.asarray(array)
        if array.ndim != 3:
            raise ValueError(f"expected (tokens, layers, top_k), got shape {array.shape}")
        return cls(
            layers=array.shape[1],
            top_k=array.shape[2],
            num_experts=num_experts,
            experts=array.reshape(-1),
        )

    def head(self, tokens: int) -> RoutedExperts:
        """The first `tokens` positions."""
        row = self.layers * self.top_k
        return self.model_copy(update={"experts": self.experts[: tokens * row]})

    def extended_by(self, later: RoutedExperts) -> RoutedExperts:
        """This routing, then `later`'s positions past its end.

        `later` covers the same sequence from position 0 (the routing a newer request returned
        for a prompt that starts with this sequence); positions this one holds are kept.
        """
        if (later.layers, later.top_k, later.num_experts) != (
            self.layers,
            self.top_k,
            self.num_experts,
        ):
            raise ValueError("routing of a different model shape cannot extend this one")
        tail = later.experts[len(self.experts) :]
        if not len(tail):
            return self
        return self.model_copy(update={"experts": np.concatenate([self.experts, tail])})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        return (self.layers, self.top_k, self.num_experts) == (
            other.layers,
            other.top_k,
            other.num_experts,
        ) and bool(np.array_equal(self.experts, other.experts))

    __hash__ = None  # type: ignore[assignment]
