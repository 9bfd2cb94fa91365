"""`OutputLedger`: where a trajectory's output lands on `rl.scored`, and whether it did.

The reward stage places each `ScoredTrajectory` explicitly on partition
`murmur2(uid) % partitions` (the Java/kafka-python/aiokafka default partitioner's choice),
and before producing it records that partition's end offset in the trajectory's EMITTING
marker. After a crash, `emitted_since(partition, offset, ids)` reads that partition from
the recorded offset to its end and returns which of the trajectory ids are there (header
`rl.trajectory_id`): an output that was acknowledged before the crash is found, one that
was not is not — so the stage can emit exactly the missing ones.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import murmur2

from workers.kafka.config import KafkaConfig

__all__ = ["TRAJECTORY_HEADER", "OutputLedger"]

log = logging.getLogger("rollout.reward.ledger")

TRAJECTORY_HEADER = "rl.trajectory_id"


class OutputLedger:
    """Partition choice, end offsets and look-back scans of the output topic."""

    def __init__(self, kafka: KafkaConfig, topic: str, *, client_id: str) -> None:
        self.topic = topic
        self._consumer = AIOKafkaConsumer(
            **kafka.aiokafka_consumer_kwargs(group_id=None), client_id=client_id
        )
        self.partitions = 0

    async def start(self, producer: AIOKafkaProducer) -> None:
        """Start the reader; learn the partition count through `producer`'s metadata."""
        await self._consumer.start()
        parts = await producer.partitions_for(self.topic)
        if not parts:
            raise RuntimeError(f"output topic {self.topic} does not exist")
        self.partitions = len(parts)

    async def stop(self) -> None:
        await self._consumer.stop()

    def partition_for(self, key: str) -> int:
        return (murmur2(key.encode()) & 0x7FFFFFFF) % self.partitions

    async def end_offsets(self, partitions: set[int]) -> dict[int, int]:
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        ends = await self._consumer.end_offsets(tps)
        return {tp.partition: offset for tp, offset in ends.items()}

    async def emitted_since(self, partition: int, offset: int, wanted: set[str]) -> set[str]:
        """Which of `wanted` appear on `partition` from `offset` up to its current end."""
        tp = TopicPartition(self.topic, partition)
        end = (await self._consumer.end_offsets([tp]))[tp]
        found: set[str] = set()
        if offset >= end:
            return found
        self._consumer.assign([tp])
        self._consumer.seek(tp, offset)
        scanned = 0
        while await self._consumer.position(tp) < end:
            batches = await self._consumer.getmany(tp, timeout_ms=1000, max_records=2000)
            for record in batches.get(tp, []):
                scanned += 1
                for name, value in record.headers or ():
                    if name == TRAJECTORY_HEADER and value.decode() in wanted:
                        found.add(value.decode())
        self._consumer.unsubscribe()
        log.info(
            "scanned %s[%d] offsets %d..%d (%d records): %d of %d already emitted",
            self.topic, partition, offset, end, scanned, len(found), len(wanted),
        )  # fmt: skip
        return found
