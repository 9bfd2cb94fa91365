"""Dead letters: a message a stage could not process, kept byte for byte with the reason.

A dead letter on `rl.dlq` has the original key and value, untouched, and headers that say
where it came from and why it failed (after Kafka Connect's `__connect.errors.*` headers):

    rl.dlq.stage          the stage that gave up, e.g. "agent-loop"
    rl.dlq.topic          topic, partition and offset of the original message
    rl.dlq.partition
    rl.dlq.offset
    rl.dlq.error.class    exception class, e.g. "DecodeError"
    rl.dlq.error.cause    a short machine-readable cause, e.g. "json", "unknown_agent"
    rl.dlq.error.message  the human-readable reason (at most 4 KiB)

The original message's own headers follow these unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from schemas.headers import DLQ_PREFIX

__all__ = ["DeadLetter"]

_MAX_MESSAGE = 4096


class DeadLetter(BaseModel):
    """One dead letter: the original bytes and why they could not be processed."""

    stage: str
    topic: str
    partition: int = Field(ge=-1)
    offset: int = Field(ge=-1)
    error_class: str
    error_message: str
    error_cause: str = "error"
    key: bytes | None = None
    value: bytes | None = None
    original_headers: list[tuple[str, bytes]] = Field(default_factory=list)

    def headers(self) -> list[tuple[str, bytes]]:
        p = DLQ_PREFIX
        own = [
            (p + "stage", self.stage.encode()),
            (p + "topic", self.topic.encode()),
            (p + "partition", str(self.partition).encode()),
            (p + "offset", str(self.offset).encode()),
            (p + "error.class", self.error_class.encode()),
            (p + "error.cause", self.error_cause.encode()),
            (p + "error.message", self.error_message[:_MAX_MESSAGE].encode("utf-8", "replace")),
        ]
        rest = [(k, v) for k, v in self.original_headers if not k.startswith(p)]
        return own + rest

    @classmethod
    def of_record(
        cls,
        stage: str,
        record: Any,
        exc: BaseException,
        *,
        cause: str | None = None,
        value: bytes | None = None,
    ) -> DeadLetter:
        """The dead letter of a consumed record (kafka-python's or aiokafka's: topic,
        partition, offset, key, value, headers) that `exc` stopped: its key, its value (or
        `value`) and its headers as they were; the cause is `cause`, else `exc.cause`."""
        key, raw = (v.encode() if isinstance(v, str) else v for v in (record.key, record.value))
        return cls(
            stage=stage,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            error_class=type(exc).__name__,
            error_cause=cause or getattr(exc, "cause", None) or "error",
            error_message=str(exc) or repr(exc),
            key=key,
            value=value if value is not None else raw,
            original_headers=[(k, bytes(v)) for k, v in (record.headers or [])],
        )

    @classmethod
    def from_message(
        cls, headers: list[tuple[str, bytes]], key: bytes | None, value: bytes | None
    ) -> DeadLetter:
        """Read a dead letter back from a consumed `rl.dlq` message."""
        p = DLQ_PREFIX
        own = {k[len(p) :]: v.decode("utf-8", "replace") for k, v in headers if k.startswith(p)}
        return cls(
            stage=own.get("stage", "?"),
            topic=own.get("topic", "?"),
            partition=int(own.get("partition", -1)),
            offset=int(own.get("offset", -1)),
            error_class=own.get("error.class", "?"),
            error_cause=own.get("error.cause", "error"),
            error_message=own.get("error.message", ""),
            key=key,
            value=value,
            original_headers=[(k, v) for k, v in headers if not k.startswith(p)],
        )
