"""`OutputLedger`: where a stage's outputs land on its output topics, and whether they did.

A stage that must emit each output exactly once places every record explicitly on partition
`partition_for(topic, key)` = `murmur2(key) % partitions` (the Java/kafka-python/aiokafka
default partitioner's choice, computed before producing so the stage knows it). Before
producing it records that partition's end offset (`end_offsets`) in its own state; after a
crash, `scan(topic, partition, offset, pick)` reads the partition from that offset to its
current end and returns what `pick` finds in each record (a key, a header), so the stage
knows which outputs are already there and produces only the others.

Partition counts are learnt once, through the stage's producer metadata, in `start`; the
reader is a group-less consumer (nothing committed). Offsets lookups are asked again while a
partition's leader is being elected (`workers.kafka.retry`): a broker's loss delays a stage's
commit, it does not end the stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import murmur2

from workers.kafka.clients import make_aio_consumer
from workers.kafka.config import KafkaConfig
from workers.kafka.retry import retrying

__all__ = ["OutputLedger", "partition_for"]

log = logging.getLogger("rollout.kafka.ledger")


def partition_for(key: str, partitions: int) -> int:
    """The default partitioner's partition of `key` (murmur2, positive, modulo)."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


class OutputLedger:
    """Partition choice, end offsets and look-back scans of a stage's output topics."""

    def __init__(self, kafka: KafkaConfig, topics: list[str], *, client_id: str) -> None:
        self.topics = topics
        self._consumer = make_aio_consumer(kafka, group_id=None, client_id=client_id)
        self.partitions: dict[str, int] = {}

    async def start(self, producer: AIOKafkaProducer) -> None:
        """Start the reader; learn each topic's partition count through `producer`'s metadata."""
        await self._consumer.start()
        for topic in self.topics:
            parts = await producer.partitions_for(topic)
            if not parts:
                raise RuntimeError(f"output topic {topic} does not exist")
            self.partitions[topic] = len(parts)

    async def stop(self) -> None:
        await self._consumer.stop()

    def partition_for(self, topic: str, key: str) -> int:
        return partition_for(key, self.partitions[topic])

    async def end_offsets(self, wanted: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        tps = [TopicPartition(t, p) for t, p in sorted(wanted)]
        ends = await retrying(lambda: self._consumer.end_offsets(tps), "end offsets")
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def beginning_offsets(
        self, wanted: Iterable[tuple[str, int]]
    ) -> dict[tuple[str, int], int]:
        tps = [TopicPartition(t, p) for t, p in sorted(wanted)]
        starts = await retrying(lambda: self._consumer.beginning_offsets(tps), "start offsets")
        return {(tp.topic, tp.partition): offset for tp, offset in starts.items()}

    async def scan(
        self, topic: str, partition: int, offset: int, pick: Callable[[Any], str | None]
    ) -> set[str]:
        """What `pick` returns (None: nothing) for the records of `topic[partition]` from
        `offset` up to the end the partition has now."""
        tp = TopicPartition(topic, partition)
        end = (await retrying(lambda: self._consumer.end_offsets([tp]), "end offsets"))[tp]
        found: set[str] = set()
        if offset >= end:
            return found
        self._consumer.assign([tp])
        self._consumer.seek(tp, offset)
        scanned = 0
        while await self._consumer.position(tp) < end:
            batches = await self._consumer.getmany(tp, timeout_ms=1000, max_records=2000)
            for record in batches.get(tp, []):
                if record.offset >= end:
                    continue
                scanned += 1
                if (value := pick(record)) is not None:
                    found.add(value)
        self._consumer.unsubscribe()
        log.info(
            "scanned %s[%d] offsets %d..%d (%d records): %d found",
            topic,
            partition,
            offset,
            end,
            scanned,
            len(found),
        )
        return found
