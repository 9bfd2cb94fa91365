"""The dead-letter error policy every stage uses: one interface, one sender per client library.

A dead letter (`schemas.deadletter.DeadLetter`) is produced to `rl.dlq` with the original
key and value and headers naming the stage, source topic/partition/offset, error class,
cause and message; the sender logs it once and, given the stage's metrics, counts it there
(`dead_letter(error_class, topic)`, which counts it as produced on the topic too). A send
returns what the library returns for the record, so the caller can commit the source offset
only once the dead letter is acknowledged: a bad message is never silently dropped, and it
never stops the stage.

`DeadLetters` is the interface: `send(letter)` and `send_record(record, exc, cause=...)`
(the letter of a consumed record, `DeadLetter.of_record`), with `topic`, `stage` and
`count`. Its two senders differ only in what a send returns:

- `KafkaDeadLetters`, over a kafka-python producer (the trainer's consumer, `EventStream`):
  the record's future (`.get(timeout)` waits for the acknowledgement).
- `AioDeadLetters`, over an aiokafka producer (the agent-loop, reward and replay stages): an
  awaitable of the record's future (await it to enqueue, await its result for the
  acknowledgement).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata
from kafka import KafkaProducer
from kafka.producer.future import FutureRecordMetadata

from schemas.deadletter import DeadLetter

__all__ = ["AioDeadLetters", "DeadLetters", "KafkaDeadLetters"]

log = logging.getLogger("rollout.dlq")

Sent = TypeVar("Sent")


class DeadLetters(Generic[Sent]):
    """Routes what a stage cannot process to the dead-letter topic; `Sent` is what a send
    returns (the library's handle on the acknowledgement)."""

    def __init__(self, producer: Any, topic: str, *, stage: str, metrics: Any = None) -> None:
        self._producer = producer
        self.topic = topic
        self.stage = stage
        self.metrics = metrics  # a `workers.metrics.StageMetrics`, or None
        self.count = 0

    def send(self, letter: DeadLetter) -> Sent:
        """Log, count and produce `letter`."""
        self.count += 1
        _warn(letter)
        if self.metrics is not None:
            self.metrics.dead_letter(letter.error_class, self.topic)
        return self._produce(letter)

    def send_record(self, record: Any, exc: BaseException, *, cause: str | None = None) -> Sent:
        """Dead-letter a consumed record (anything with topic/partition/offset/key/value/
        headers) that `exc` stopped; the cause is `cause`, else `exc.cause`."""
        return self.send(DeadLetter.of_record(self.stage, record, exc, cause=cause))

    def _produce(self, letter: DeadLetter) -> Sent:
        raise NotImplementedError


class KafkaDeadLetters(DeadLetters[FutureRecordMetadata]):
    """Dead letters through a kafka-python producer."""

    _producer: KafkaProducer

    def _produce(self, letter: DeadLetter) -> FutureRecordMetadata:
        return self._producer.send(
            self.topic, key=letter.key, value=letter.value, headers=letter.headers()
        )


class AioDeadLetters(DeadLetters[Awaitable["asyncio.Future[RecordMetadata]"]]):
    """Dead letters through an aiokafka producer."""

    _producer: AIOKafkaProducer

    def _produce(self, letter: DeadLetter) -> Awaitable[asyncio.Future[RecordMetadata]]:
        return self._producer.send(
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
