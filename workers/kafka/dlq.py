"""The dead-letter error policy every stage uses.

A dead letter (`schemas.deadletter.DeadLetter`) is produced to `rl.dlq` with the original
key and value and headers naming the stage, source topic/partition/offset, error class,
cause and message; the sender logs it once and counts it in the stage's metrics
(`dead_letter(error_class, topic)`, which counts it as produced on the topic too). Both
senders return the broker's future, so the caller can commit the source offset only once
the dead letter is acknowledged: a bad message is never silently dropped, and it never
stops the stage.

- `DeadLetterQueue`: over a kafka-python producer (the trainer's consumer, the producer CLI).
- `AioDeadLetters`: over an aiokafka producer (the agent-loop, reward and replay stages).
"""

from __future__ import annotations

import logging
from typing import Any

from kafka import KafkaProducer
from kafka.producer.future import FutureRecordMetadata

from schemas.deadletter import DeadLetter

__all__ = ["AioDeadLetters", "DeadLetterQueue"]

log = logging.getLogger("rollout.dlq")


class DeadLetterQueue:
    """Routes records a stage cannot process to the dead-letter topic."""

    def __init__(self, producer: KafkaProducer, topic: str, stage: str) -> None:
        self._producer = producer
        self.topic = topic
        self.stage = stage
        self.count = 0

    def send(
        self, record: Any, exc: BaseException, *, cause: str | None = None
    ) -> FutureRecordMetadata:
        """Dead-letter a consumed record: anything with topic/partition/offset/key/value/headers."""
        return self.send_letter(DeadLetter.of_record(self.stage, record, exc, cause=cause))

    def send_letter(self, letter: DeadLetter) -> FutureRecordMetadata:
        self.count += 1
        _warn(letter)
        return self._producer.send(
            self.topic, key=letter.key, value=letter.value, headers=letter.headers()
        )

    def send_value(
        self,
        *,
        key: str | bytes | None,
        value: bytes | None,
        exc: BaseException,
        source_topic: str = "",
        cause: str | None = None,
    ) -> FutureRecordMetadata:
        """Dead-letter something that was never a consumed record (e.g. a dataset row)."""
        letter = DeadLetter(
            stage=self.stage,
            topic=source_topic,
            partition=-1,
            offset=-1,
            error_class=type(exc).__name__,
            error_cause=cause or getattr(exc, "cause", None) or "error",
            error_message=str(exc) or repr(exc),
            key=_as_bytes(key),
            value=value,
        )
        return self.send_letter(letter)


class AioDeadLetters:
    """Dead letters through a stage's aiokafka producer, counted in its metrics."""

    def __init__(self, producer: Any, topic: str, metrics: Any = None) -> None:
        self._producer = producer
        self.topic = topic
        self.metrics = metrics  # a `workers.metrics.StageMetrics`, or None
        self.count = 0

    async def send(self, letter: DeadLetter) -> Any:
        """Enqueue `letter`; the broker's future (await it for the acknowledgement)."""
        self.count += 1
        _warn(letter)
        if self.metrics is not None:
            self.metrics.dead_letter(letter.error_class, self.topic)
        return await self._producer.send(
            self.topic, letter.value, key=letter.key, headers=letter.headers()
        )


def _warn(letter: DeadLetter) -> None:
    log.warning(
        "dead-lettering %s[%d]@%d from stage %s: %s (%s): %s",
        letter.topic,
        letter.partition,
        letter.offset,
        letter.stage,
        letter.error_class,
        letter.error_cause,
        letter.error_message[:200],
    )


def _as_bytes(data: str | bytes | None) -> bytes | None:
    if data is None or isinstance(data, bytes):
        return data
    return data.encode()
