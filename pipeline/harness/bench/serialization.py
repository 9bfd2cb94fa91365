"""`rollout bench serialization`: the wire codec against plain JSON lists.

Encode + decode (with full validation) of a `TurnEvent` carrying N tokens and their logprobs,
against a baseline in the same run that carries the same ids and logprobs as plain JSON lists
through the same pydantic validation and the same orjson envelope. Rounds alternate between
the two so that machine noise hits both alike; the figure is the median round.

`image_*`: the bytes one image prompt costs on the wire (issue 32), its image (a PNG of
`image_side`² noise pixels) carried by reference (`image_ref`: sha256, type, size) against
inline (the same reference with the bytes base64, `media.inline_max_bytes`), on each topic
that carries it: the prompt (`rl.prompts`), turn 0 (`rl.turns`) and a group of 4 samples
(`rl.replay`, every sample carries the prompt's images); the baseline is the prompt as the
user wrote it, the image a `data:` URI. Sizes are exact, not timed.
"""

from __future__ import annotations

import base64
import hashlib
import io
import statistics
import time
from typing import Any

import numpy as np
import orjson

from schemas.codec import decode, encode
from schemas.events import PromptEvent, ScoredTrajectory, TrainingGroup, TurnEvent
from schemas.media import ImageRef

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


def _png(side: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _image_prompt(content: list[dict[str, Any]]) -> PromptEvent:
    text = {"type": "text", "text": "Find x. Put the answer in \\boxed{}."}
    return PromptEvent(
        uid="bench-0",
        data_source="hiyouga/geometry3k",
        prompt=[{"role": "user", "content": [*content, text]}],
    )


def _image_events(ref: ImageRef, samples: int = 4) -> dict[str, bytes]:
    """The prompt, turn 0 and a group of `samples` carrying one image by `ref`."""
    prompt = _image_prompt([{"type": "image_ref", "image_ref": ref.model_dump()}])
    turn = _event(256, 0).model_copy(
        update={"turn_index": 0, "prompt_ids": np.arange(300, dtype=np.int32), "images": [ref]}
    )
    scored = [
        ScoredTrajectory(
            uid="bench-0",
            trajectory_id=f"bench-0/{i}",
            sample_index=i,
            attempt_id="0123456789abcdef",
            data_source="hiyouga/geometry3k",
            prompt_ids=np.arange(300, dtype=np.int32),
            response_ids=turn.token_ids,
            response_mask=np.ones(256, dtype=np.uint8),
            response_logprobs=turn.logprobs,
            num_turns=2,
            reward_score=1.0,
            extra_fields={"min_global_steps": 3, "max_global_steps": 4},
            images=[ref],
        )
        for i in range(samples)
    ]
    group = TrainingGroup(
        uid="bench-0",
        samples=scored,
        advantages=[0.0] * samples,
        min_global_steps=3,
        max_global_steps=4,
        emitted_at_version=4,
    )
    return {"prompt": encode(prompt), "turn0": encode(turn), "group": encode(group)}


def image_figures(side: int = 256, seed: int = 0) -> dict[str, Any]:
    """Bytes on the wire of one image prompt, by reference vs inline (module docstring)."""
    data = _png(side, seed)
    ref = ImageRef(sha256=hashlib.sha256(data).hexdigest(), mime_type="image/png", size=len(data))
    inline = ref.model_copy(update={"data": base64.b64encode(data).decode()})
    by_ref, by_value = _image_events(ref), _image_events(inline)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    as_written = encode(_image_prompt([{"type": "image_url", "image_url": {"url": uri}}]))
    out: dict[str, Any] = {"image_side": side, "image_bytes": len(data)}
    out["image_baseline_prompt_bytes"] = len(as_written)
    for topic in by_ref:
        out[f"image_{topic}_bytes_by_ref"] = len(by_ref[topic])
        out[f"image_{topic}_bytes_inline"] = len(by_value[topic])
        out[f"image_{topic}_inline_over_ref"] = round(len(by_value[topic]) / len(by_ref[topic]), 2)
    out["image_prompt_baseline_over_ref"] = round(len(as_written) / len(by_ref["prompt"]), 2)
    return out


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
        **image_figures(seed=seed),
    }
