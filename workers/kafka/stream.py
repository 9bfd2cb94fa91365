"""`EventStream`: typed events from Kafka, with bad records dead-lettered, never fatal.

Each `poll()` returns the records it could decode (as `Received(record, event)`); a record
that does not decode into one of the accepted event kinds goes to the dead-letter topic with
its original bytes and the reason, and `poll()` waits for the broker to acknowledge that
dead letter before returning — so committing after processing the returned events can
never commit past an unrecorded failure.

Offsets are committed only by `commit()`, explicitly, after the caller's outputs are
acknowledged (at-least-once; consumers downstream de-duplicate).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from schemas.codec import decode
from schemas.errors import DecodeError
from workers.kafka.clients import ack_wait_s, make_consumer, make_producer
from workers.kafka.config import KafkaConfig
from workers.kafka.dlq import KafkaDeadLetters
from workers.kafka.retry import call_retrying

__all__ = ["EventStream", "Received"]

log = logging.getLogger("rollout.stream")


@dataclass(frozen=True, slots=True)
class Received:
    record: Any
    event: Any


class EventStream:
    """Consume events of the accepted kinds; dead-letter everything else."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: list[str],
        *,
        group_id: str | None,
        stage: str,
        dlq_topic: str,
        kinds: tuple[type, ...] | None = None,
        consumer: KafkaConsumer | None = None,
        **consumer_overrides: Any,
    ) -> None:
        self.stage = stage
        self.kinds = kinds
        self._consumer = consumer or make_consumer(
            kafka, *topics, group_id=group_id, name=stage, **consumer_overrides
        )
        self._producer = make_producer(kafka, name=f"{stage}-dlq")
        self._ack_s = ack_wait_s(kafka)
        self.dlq = KafkaDeadLetters(self._producer, dlq_topic, stage=stage)
        self._next: dict[TopicPartition, int] = {}

    @property
    def consumer(self) -> KafkaConsumer:
        return self._consumer

    def poll(self, timeout_ms: int = 1000, max_records: int = 500) -> list[Received]:
        batches = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        good: list[Received] = []
        pending = []
        for tp, records in batches.items():
            for record in records:
                try:
                    event = decode(record.value)
                    if self.kinds is not None and not isinstance(event, self.kinds):
                        wanted = ", ".join(k.__name__ for k in self.kinds)
                        raise DecodeError(
                            f"{type(event).__name__} does not belong on {record.topic} "
                            f"(expected {wanted})",
                            cause="wrong_kind",
                        )
                except DecodeError as exc:
                    pending.append(self.dlq.send_record(record, exc))
                else:
                    good.append(Received(record, event))
                self._next[tp] = record.offset + 1
        for future in pending:
            future.get(timeout=self._ack_s)
        return good

    def __iter__(self) -> Iterator[Received]:
        while True:
            yield from self.poll()

    def commit(self) -> None:
        """Commit the position after every record returned so far."""
        if not self._next:
            return
        offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in self._next.items()}
        call_retrying(lambda: self._consumer.commit(offsets), "commit")

    def close(self) -> None:
        try:
            self._producer.flush(timeout=self._ack_s)
        finally:
            self._producer.close()
            self._consumer.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
