"""`ScoredLedger`: how far `rl.scored` reached, and which trajectories it holds since then.

The reward stage places each `ScoredTrajectory` explicitly on partition
`murmur2(uid) % partitions` (`workers.kafka.ledger`, the default partitioner's choice),
with header `rl.trajectory_id`. With every offset commit it stores a *recovery point* in the
commit's metadata: the end offset of each `rl.scored` partition, read while none of its
outputs was unacknowledged. Every output of a batch after that commit lands at or past
those offsets. After a crash, the stage that is assigned the partition reads `rl.scored`
from the recovery point to its end (`emitted_since`) and so knows which of the trajectories
it is about to complete again were already emitted.
"""

from __future__ import annotations

from typing import Any

from schemas.headers import RECOVERY_POINT_TAG, TRAJECTORY_ID
from workers.kafka.config import KafkaConfig
from workers.kafka.ledger import OutputLedger

__all__ = [
    "MAX_OUTPUT_PARTITIONS",
    "ScoredLedger",
    "format_recovery_point",
    "parse_recovery_point",
]

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


class ScoredLedger(OutputLedger):
    """The reward stage's ledger of its one output topic: trajectories found by header."""

    def __init__(self, kafka: KafkaConfig, topic: str, *, client_id: str) -> None:
        super().__init__(kafka, [topic], client_id=client_id)
        self.topic = topic

    @property
    def partition_count(self) -> int:
        return self.partitions[self.topic]

    def partition_of(self, key: str) -> int:
        return self.partition_for(self.topic, key)

    async def topic_end_offsets(self) -> dict[int, int]:
        ends = await self.end_offsets(self._all())
        return {p: offset for (_, p), offset in ends.items()}

    async def topic_beginning_offsets(self) -> dict[int, int]:
        starts = await self.beginning_offsets(self._all())
        return {p: offset for (_, p), offset in starts.items()}

    async def emitted_since(self, partition: int, offset: int) -> set[str]:
        """The trajectory ids on `partition` from `offset` up to its current end."""
        return await self.scan(self.topic, partition, offset, _trajectory_id)

    def _all(self) -> list[tuple[str, int]]:
        return [(self.topic, p) for p in range(self.partition_count)]


def _trajectory_id(record: Any) -> str | None:
    for name, value in record.headers or ():
        if name == TRAJECTORY_ID:
            return str(value.decode())
    return None
