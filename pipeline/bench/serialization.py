"""`rollout bench serialization`: the wire codec against plain JSON lists.

Encode + decode (with full validation) of a `TurnEvent` carrying N tokens and their logprobs,
against a baseline in the same run that carries the same ids and logprobs as plain JSON lists
through the same pydantic validation and the same orjson envelope. Rounds alternate between
the two so that machine noise hits both alike; the figure is the median round.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict

from schemas.codec import decode, encode
from schemas.events import TurnEvent

__all__ = ["run"]


class _PlainTurn(BaseModel):
    """The baseline: TurnEvent's fields with token ids and logprobs as JSON lists."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    kind: Literal["turn"] = "turn"
    created_at: float
    trajectory_id: str
    uid: str
    sample_index: int
    attempt_id: str
    turn_index: int
    role: Literal["assistant", "tool", "user"]
    token_ids: list[int]
    logprobs: list[float] | None
    min_global_steps: int
    max_global_steps: int
    stop_reason: str | None = None
    final: bool = False


def _event(tokens: int, seed: int) -> TurnEvent:
    rng = np.random.default_rng(seed)
    return TurnEvent(
        trajectory_id="bench-0/0",
        uid="bench-0",
        sample_index=0,
        attempt_id="0123456789abcdef",
        turn_index=1,
        role="assistant",
        token_ids=rng.integers(0, 151_936, tokens, dtype=np.int32),
        logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
        min_global_steps=3,
        max_global_steps=4,
        stop_reason="stop",
    )


def _rate(fn: Any, seconds: float) -> float:
    count = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        fn()
        count += 1
        now = time.perf_counter()
        if now >= deadline:
            return count / (now - started)


def run(
    tokens: int = 4096, rounds: int = 5, seconds_per_round: float = 0.4, seed: int = 0
) -> dict[str, Any]:
    event = _event(tokens, seed)
    packed_bytes = encode(event)
    assert decode(packed_bytes) == event

    plain = _PlainTurn(
        created_at=event.created_at,
        trajectory_id=event.trajectory_id,
        uid=event.uid,
        sample_index=event.sample_index,
        attempt_id=event.attempt_id,
        turn_index=event.turn_index,
        role=event.role,
        token_ids=event.token_ids.tolist(),
        logprobs=event.logprobs.tolist() if event.logprobs is not None else None,
        min_global_steps=event.min_global_steps,
        max_global_steps=event.max_global_steps,
        stop_reason=event.stop_reason,
    )
    plain_bytes = orjson.dumps(plain.model_dump(mode="json"))

    def packed_round_trip() -> None:
        decode(encode(event))

    def plain_round_trip() -> None:
        _PlainTurn.model_validate(orjson.loads(orjson.dumps(plain.model_dump(mode="json"))))

    packed_rates, plain_rates = [], []
    for _ in range(rounds):
        packed_rates.append(_rate(packed_round_trip, seconds_per_round))
        plain_rates.append(_rate(plain_round_trip, seconds_per_round))
    packed_rate = statistics.median(packed_rates)
    plain_rate = statistics.median(plain_rates)
    return {
        "benchmark": "serialization",
        "tokens": tokens,
        "rounds": rounds,
        "packed_events_per_s": round(packed_rate, 1),
        "baseline_events_per_s": round(plain_rate, 1),
        "ratio": round(packed_rate / plain_rate, 2),
        "bytes_per_token": round(len(packed_bytes) / tokens, 3),
        "baseline_bytes_per_token": round(len(plain_bytes) / tokens, 3),
        "message_bytes": len(packed_bytes),
        "baseline_message_bytes": len(plain_bytes),
        "packed_tokens_per_s": round(packed_rate * tokens),
    }
