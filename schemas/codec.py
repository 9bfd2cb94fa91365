"""The one wire codec of the pipeline: JSON values, packed arrays, metadata headers.

A message value is one JSON object: the event's fields plus `schema_version` and `kind`
(the envelope), encoded with orjson. Token ids, logprobs and masks are packed arrays
(`schemas.arrays`), about 10.7 bytes per token for ids + logprobs. Decoding validates
against the `Event` union in one pass and raises `DecodeError` for anything else: not JSON,
not an object, unknown kind or schema version, missing or mistyped fields.

Every message also carries headers so consumers can route or filter without decoding:
`rl.schema_version`, `rl.kind`, and for versioned events `rl.min_global_steps` and
`rl.max_global_steps` (decimal ASCII).
"""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas import headers as h
from schemas.errors import DecodeError
from schemas.events import SCHEMA_VERSION, Event, EventBase

__all__ = ["decode", "decode_as", "encode", "headers_for"]

_EVENT: TypeAdapter[Any] = TypeAdapter(Event)
_SCHEMA_BYTES = str(SCHEMA_VERSION).encode()

E = TypeVar("E", bound=BaseModel)


def encode(event: EventBase) -> bytes:
    """The JSON bytes of an event (packed arrays as base64 strings)."""
    return orjson.dumps(event.model_dump(mode="json"))


def decode(value: bytes | bytearray | memoryview | str | None) -> Any:
    """Validate bytes into the event they hold; `DecodeError` if they hold none."""
    if value is None:
        raise DecodeError("empty message value (tombstone)", cause="empty")
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"not valid JSON: {exc}", cause="json") from exc
    if not isinstance(data, dict):
        raise DecodeError(f"expected a JSON object, got {type(data).__name__}", cause="shape")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise DecodeError(
            f"unsupported schema_version {version!r} (this build reads {SCHEMA_VERSION})",
            cause="schema_version",
        )
    try:
        return _EVENT.validate_python(data)
    except ValidationError as exc:
        raise DecodeError(_summarise(exc), cause="validation") from exc


def decode_as(value: bytes | bytearray | memoryview | str | None, kind: type[E]) -> E:
    """Decode and check the event is of the expected class."""
    event = decode(value)
    if not isinstance(event, kind):
        raise DecodeError(
            f"expected {kind.__name__}, got {type(event).__name__}", cause="wrong_kind"
        )
    return event


def headers_for(event: EventBase) -> list[tuple[str, bytes]]:
    """Kafka headers that describe an event without decoding it."""
    headers = [(h.SCHEMA, _SCHEMA_BYTES), (h.KIND, str(event.kind).encode())]  # type: ignore[attr-defined]
    low, high = _version_tags(event)
    if low is not None and high is not None:
        headers.append((h.MIN_VERSION, str(low).encode()))
        headers.append((h.MAX_VERSION, str(high).encode()))
    return headers


def _version_tags(event: EventBase) -> tuple[int | None, int | None]:
    extra = getattr(event, "extra_fields", None)
    if extra is not None:
        return extra.min_global_steps, extra.max_global_steps
    low = getattr(event, "min_global_steps", None)
    if low is not None:
        return low, getattr(event, "max_global_steps", None)
    version = getattr(event, "version", None)
    if isinstance(version, int):
        return version, version
    return None, None


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(parts)
    suffix = f" (+{more} more)" if more > 0 else ""
    return "invalid event: " + "; ".join(parts) + suffix
