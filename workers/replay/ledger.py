"""`GroupLedger`: where a group's output lands on `rl.replay`/`rl.stale`, and whether it did.

Every group is produced with key = uid to partition `murmur2(uid) % partitions` of its
destination topic (the default partitioner's choice, set explicitly so the stage knows it
before producing). Before producing, the stage records that partition's end offset in the
group's EMITTING marker; after a crash, `emitted_since(topic, partition, offset, uids)` reads
that partition from the recorded offset to its end and returns which of the uids are there.
A uid is produced by this stage at most once per topic, so its key there means "emitted".
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import murmur2

from workers.kafka.config import KafkaConfig

__all__ = ["GroupLedger"]

log = logging.getLogger("rollout.replay.ledger")


class GroupLedger:
    """Partition choice, end offsets and look-back scans of the stage's output topics."""

    def __init__(self, kafka: KafkaConfig, topics: list[str], *, client_id: str) -> None:
        self.topics = topics
        self._consumer = AIOKafkaConsumer(
            **kafka.aiokafka_consumer_kwargs(group_id=None), client_id=client_id
        )
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
        return (murmur2(key.encode()) & 0x7FFFFFFF) % self.partitions[topic]

    async def end_offsets(self, wanted: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
        tps = [TopicPartition(t, p) for t, p in sorted(wanted)]
        ends = await self._consumer.end_offsets(tps)
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def emitted_since(
        self, topic: str, partition: int, offset: int, uids: set[str]
    ) -> set[str]:
        """Which of `uids` appear as keys on `topic[partition]` from `offset` to its end."""
        tp = TopicPartition(topic, partition)
        end = (await self._consumer.end_offsets([tp]))[tp]
        found: set[str] = set()
        if offset >= end:
            return found
        wanted = {u.encode(): u for u in uids}
        self._consumer.assign([tp])
        self._consumer.seek(tp, offset)
        scanned = 0
        while await self._consumer.position(tp) < end:
            batches = await self._consumer.getmany(tp, timeout_ms=1000, max_records=2000)
            for record in batches.get(tp, []):
                scanned += 1
                if record.key in wanted:
                    found.add(wanted[record.key])
        self._consumer.unsubscribe()
        log.info(
            "scanned %s[%d] offsets %d..%d (%d records): %d of %d groups already emitted",
            topic, partition, offset, end, scanned, len(found), len(uids),
        )  # fmt: skip
        return found
