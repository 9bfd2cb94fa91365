"""A topic's records as a person reads them: `rollout consume`'s one JSON object per record.

Reading never writes: a record that does not decode is shown as it is (its bytes and the
error), not dead-lettered, so looking at a topic — `rl.dlq` above all — leaves every topic as
it was. A dead letter is shown with why it is there (`schemas.deadletter`'s headers: stage,
cause, error, and the topic/partition/offset it came from) beside the original event.

    {"event": {...}}                                   a record that decodes
    {"undecodable": {"error": ..., "value": ...}, ...} one that does not (value as text, or
                                                       base64 when it is not UTF-8)
    {"dead_letter": {...}, "event"|"undecodable": ...} a record of the dead-letter topic

Every object also has `topic`, `partition` and `offset` of the record shown. Given a
tokenizer (`rollout consume --decode`), an event's token arrays are also shown as text:
`prompt_text` and `response_text` beside a scored trajectory's ids (each sample of a
training group), `text` beside a turn's.
"""

from __future__ import annotations

import base64
from typing import Any

from schemas.codec import decode
from schemas.deadletter import DeadLetter
from schemas.errors import DecodeError
from schemas.events import ScoredTrajectory, TrainingGroup, TurnEvent
from schemas.headers import DLQ_PREFIX

__all__ = ["is_dead_letter", "show"]


def is_dead_letter(headers: list[tuple[str, bytes]] | None) -> bool:
    return any(key.startswith(DLQ_PREFIX) for key, _ in headers or [])


def show(
    topic: str,
    partition: int,
    offset: int,
    value: bytes | None,
    headers: Any = None,
    *,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The printable form of one record (see the module docstring)."""
    headers = [(k, bytes(v)) for k, v in headers or []]
    out: dict[str, Any] = {"topic": topic, "partition": partition, "offset": offset}
    if is_dead_letter(headers):
        letter = DeadLetter.from_message(headers, None, value)
        out["dead_letter"] = {
            "stage": letter.stage,
            "cause": letter.error_cause,
            "error_class": letter.error_class,
            "error": letter.error_message,
            "origin": {
                "topic": letter.topic,
                "partition": letter.partition,
                "offset": letter.offset,
            },
        }
    try:
        event = decode(value)
    except DecodeError as exc:
        out["undecodable"] = {"error": str(exc), **_raw(value)}
        return out
    out["event"] = event.model_dump(mode="json")
    if tokenizer is not None:
        _add_text(out["event"], event, tokenizer)
    return out


def _add_text(shown: dict[str, Any], event: Any, tokenizer: Any) -> None:
    """The text of `event`'s token arrays, into its printed form `shown`."""

    def text(ids: Any) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    if isinstance(event, ScoredTrajectory):
        shown["prompt_text"] = text(event.prompt_ids)
        shown["response_text"] = text(event.response_ids)
    elif isinstance(event, TrainingGroup):
        for sample, printed in zip(event.samples, shown["samples"], strict=True):
            _add_text(printed, sample, tokenizer)
    elif isinstance(event, TurnEvent):
        shown["text"] = text(event.token_ids)
        if event.prompt_ids is not None:
            shown["prompt_text"] = text(event.prompt_ids)


def _raw(value: bytes | None) -> dict[str, Any]:
    if value is None:
        return {"value": None}
    try:
        return {"value": bytes(value).decode("utf-8")}
    except UnicodeDecodeError:
        return {"value_base64": base64.b64encode(bytes(value)).decode("ascii")}
