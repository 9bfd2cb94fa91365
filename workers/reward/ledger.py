"""`OutputLedger`: how far `rl.scored` reached, and which trajectories it holds since then.

The reward stage places each `ScoredTrajectory` explicitly on partition
`murmur2(uid) % partitions` (the Java/kafka-python/aiokafka default partitioner's choice),
with header `rl.trajectory_id`. With every offset commit it stores a *recovery point* in the
commit's metadata: the end offset of each `rl.scored` partition, read while none of its
outputs was unacknowledged. Every output of a batch after that commit lands at or past
those offsets. After a crash, the stage that is assigned the partition reads `rl.scored`
from the recovery point to its end (`emitted_since`) and so knows which of the trajectories
it is about to complete again were already emitted.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import murmur2

from schemas.headers import RECOVERY_POINT_TAG, TRAJECTORY_ID
from workers.kafka.config import KafkaConfig

__all__ = [
    "MAX_OUTPUT_PARTITIONS",
    "OutputLedger",
    "format_recovery_point",
    "parse_recovery_point",
]

log = logging.getLogger("rollout.reward.ledger")

_PREFIX = RECOVERY_POINT_TAG
# Kafka keeps at most `offset.metadata.max.bytes` (4096 by default) of commit metadata;
# an offset takes at most 20 characters (with its comma), usually far fewer.
MAX_OUTPUT_PARTITIONS = 200


def format_recovery_point(ends: dict[int, int]) -> str:
    """The commit metadata for `rl.scored` end offsets (partition → offset, all partitions)."""
    return _PREFIX + ",".join(str(ends[p]) for p in range(len(ends)))


def parse_recovery_point(text: str | None) -> dict[int, int] | None:
    """Partition → offset from `format_recovery_point`'s text; None if it is not one."""
    if not text or not text.startswith(_PREFIX):
        return None
    try:
        offsets = [int(part) for part in text[len(_PREFIX) :].split(",")]
    except ValueError:
        return None
    return dict(enumerate(offsets))


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

    def _all(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in range(self.partitions)]

    async def end_offsets(self) -> dict[int, int]:
        ends = await self._consumer.end_offsets(self._all())
        return {tp.partition: offset for tp, offset in ends.items()}

    async def beginning_offsets(self) -> dict[int, int]:
        starts = await self._consumer.beginning_offsets(self._all())
        return {tp.partition: offset for tp, offset in starts.items()}

    async def emitted_since(self, partition: int, offset: int) -> set[str]:
        """The trajectory ids on `partition` from `offset` up to its current end."""
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
                if record.offset >= end:
                    continue
                scanned += 1
                for name, value in record.headers or ():
                    if name == TRAJECTORY_ID:
                        found.add(value.decode())
        self._consumer.unsubscribe()
        log.info(
            "scanned %s[%d] offsets %d..%d: %d trajectories emitted",
            self.topic, partition, offset, end, len(found),
        )  # fmt: skip
        return found
