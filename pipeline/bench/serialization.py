"""`rollout bench serialization`: the wire codec against plain JSON lists.

Encode + decode (with full validation) of a `TurnEvent` carrying N tokens and their logprobs,
against a baseline in the same run that carries the same ids and logprobs as plain JSON lists
through the same pydantic validation and the same orjson envelope. Rounds alternate between
the two so that machine noise hits both alike; the figure is the median round.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import orjson

from schemas.codec import decode, encode
from schemas.events import TurnEvent

__all__ = ["run"]


class _PlainTurn(TurnEvent):
    """The baseline: TurnEvent itself, its token arrays as JSON lists of numbers."""

    token_ids: list[int]  # type: ignore[assignment]
    logprobs: list[float] | None = None  # type: ignore[assignment]
    prompt_ids: list[int] | None = None  # type: ignore[assignment]


def _plain(event: TurnEvent) -> _PlainTurn:
    """`event` with every field carried over by name, its arrays as lists."""
    values = {name: getattr(event, name) for name in TurnEvent.model_fields}
    return _PlainTurn(
        **{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in values.items()}
    )


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

    plain = _plain(event)
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
