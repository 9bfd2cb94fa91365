"""`ChangelogTable`: a stage's keyed state, in memory, backed by a compacted changelog topic.

The state of the partitions this process owns, in memory, backed by a compacted changelog
topic with as many partitions as the source. A write sets the entry and sends the same
bytes to the changelog partition of the key's source partition through the stage's own
idempotent producer, returning the broker's acknowledgement; a delete sends a tombstone;
`put` sets an entry in memory only, for the stage to write once it may be persisted.
`restore(partitions)` reads those changelog partitions from the beginning to their end
offset and applies them. `StageLoop` (`workers.kafka.stateful`) restores and drops the
partitions as the group's assignment changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Iterable
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition

from workers.kafka.clients import make_aio_consumer
from workers.kafka.config import KafkaConfig
from workers.kafka.retry import retrying

__all__ = ["ChangelogTable"]

log = logging.getLogger("rollout.kafka.stage")


class ChangelogTable:
    """key → bytes for the owned partitions; every write also goes to the changelog topic."""

    def __init__(self, kafka: KafkaConfig, topic: str, *, client_id: str) -> None:
        self.kafka, self.topic, self.client_id = kafka, topic, client_id
        self.data: dict[bytes, bytes] = {}
        self.producer: AIOKafkaProducer | None = None  # set by the stage once started
        self._partition_of: dict[bytes, int] = {}
        self.partitions: set[int] = set()

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def items(self) -> list[tuple[bytes, bytes, int]]:
        """(key, value, partition) of every entry (a copy)."""
        return [(k, v, self._partition_of[k]) for k, v in self.data.items()]

    def write(self, key: bytes, value: bytes | None, partition: int) -> Awaitable[Any]:
        """Set (value) or delete (None) an entry; a coroutine whose result is the ack future."""
        assert self.producer is not None, "the stage sets the table's producer before writing"
        self._apply(key, value, partition)
        return self.producer.send(self.topic, value, key=key, partition=partition)

    def put(self, key: bytes, value: bytes, partition: int) -> None:
        """Set an entry in memory only; the stage `write`s it once it may be persisted."""
        self._apply(key, value, partition)

    def _apply(self, key: bytes, value: bytes | None, partition: int) -> None:
        if value is None:
            self.data.pop(key, None)
            self._partition_of.pop(key, None)
        else:
            self.data[key] = value
            self._partition_of[key] = partition

    def drop(self, partitions: Iterable[int]) -> None:
        """Forget the entries of `partitions` (revoked: another process owns them now)."""
        gone = set(partitions)
        for key in [k for k, p in self._partition_of.items() if p in gone]:
            del self.data[key]
            del self._partition_of[key]
        self.partitions -= gone

    async def restore(self, partitions: Iterable[int]) -> int:
        """Read the changelog of `partitions` from the beginning to its end; records applied."""
        wanted = sorted(set(partitions) - self.partitions)
        if not wanted:
            return 0
        consumer = make_aio_consumer(
            self.kafka, group_id=None, client_id=f"{self.client_id}-restore"
        )
        await consumer.start()
        applied = 0
        started = time.monotonic()
        try:
            tps = [TopicPartition(self.topic, p) for p in wanted]
            consumer.assign(tps)
            ends = await retrying(lambda: consumer.end_offsets(tps), f"end offsets of {self.topic}")
            await consumer.seek_to_beginning(*tps)
            left = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
            while left:
                batches = await consumer.getmany(*left, timeout_ms=1000, max_records=10_000)
                for tp, records in batches.items():
                    for record in records:
                        if record.offset < ends[tp]:
                            self._apply(record.key, record.value, tp.partition)
                            applied += 1
                left = {tp for tp in left if await consumer.position(tp) < ends[tp]}
        finally:
            await consumer.stop()
        self.partitions |= set(wanted)
        log.info(
            "restored %s partitions %s: %d records, %d entries, %.2fs",
            self.topic,
            wanted,
            applied,
            len(self.data),
            time.monotonic() - started,
        )
        return applied
