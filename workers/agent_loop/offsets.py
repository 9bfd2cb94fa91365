"""Per-partition offset tracking for a consumer that finishes messages out of order.

The agent-loop worker runs many prompts at once and they finish in any order. Kafka stores
one committed offset per partition, meaning "everything before this is done", so the worker
may only commit the contiguous prefix of finished offsets: if offsets 5, 6 and 8 are done
but 7 is not, the committable position is 7 (not 9). A crash then redelivers 7 and 8; 8 is
done twice, which downstream de-duplication absorbs — but 7 is never lost.

Pure logic, no Kafka: `OffsetTracker` is keyed by any hashable partition id.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["OffsetTracker", "PartitionOffsets"]


@dataclass
class PartitionOffsets:
    """Started and finished offsets of one partition.

    Records of a partition arrive in offset order, so every offset below the highest one
    started either was started too or does not exist (compacted away, a transaction marker).
    The commit position is therefore the lowest unfinished offset, or one past the highest
    started offset when nothing is unfinished.
    """

    highest: int | None = None
    pending: set[int] = field(default_factory=set)
    _heap: list[int] = field(default_factory=list)  # pending offsets; finished ones removed lazily
    committed: int | None = None  # what was last handed out for commit
    announced: int | None = None  # the started-through last committed with it (metadata)

    def start(self, offset: int) -> None:
        if self.highest is not None and offset <= self.highest:
            return  # a redelivery of something already tracked
        self.highest = offset
        self.pending.add(offset)
        heapq.heappush(self._heap, offset)

    def finish(self, offset: int) -> None:
        self.pending.discard(offset)
        while self._heap and self._heap[0] not in self.pending:
            heapq.heappop(self._heap)

    @property
    def next_commit(self) -> int | None:
        if self._heap:
            return self._heap[0]
        return None if self.highest is None else self.highest + 1

    @property
    def in_flight(self) -> int:
        return len(self.pending)


class OffsetTracker:
    """Contiguous-prefix commit positions for every partition a consumer owns."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, PartitionOffsets] = {}

    def start(self, partition: Hashable, offset: int) -> None:
        self._parts.setdefault(partition, PartitionOffsets()).start(offset)

    def finish(self, partition: Hashable, offset: int) -> None:
        part = self._parts.get(partition)
        if part is not None:
            part.finish(offset)

    def committable(self) -> dict[Hashable, int]:
        """Partitions whose commit position moved since the last call → that position."""
        out: dict[Hashable, int] = {}
        for partition, part in self._parts.items():
            if part.next_commit is not None and part.next_commit != part.committed:
                out[partition] = part.next_commit
        return out

    def commit_points(self) -> dict[Hashable, tuple[int, int]]:
        """Partitions whose commit position or started-through offset moved since the last
        `mark_points` → (position, started-through). The second goes out as the commit's
        metadata, so the rest of the group sees what this worker has admitted, finished or
        not (the admission gate counts it)."""
        out: dict[Hashable, tuple[int, int]] = {}
        for partition, part in self._parts.items():
            if part.next_commit is None or part.highest is None:
                continue
            point = (part.next_commit, part.highest + 1)
            if (part.committed, part.announced) != point:
                out[partition] = point
        return out

    def mark_points(self, points: dict[Hashable, tuple[int, int]]) -> None:
        for partition, (position, started) in points.items():
            part = self._parts.get(partition)
            if part is not None:
                part.committed, part.announced = position, started

    def mark_committed(self, positions: dict[Hashable, int]) -> None:
        for partition, position in positions.items():
            part = self._parts.get(partition)
            if part is not None:
                part.committed = position

    def started_through(self, partition: Hashable) -> int | None:
        """One past the highest offset started on `partition` (None: nothing started)."""
        part = self._parts.get(partition)
        return None if part is None or part.highest is None else part.highest + 1

    def position(self, partition: Hashable) -> int | None:
        part = self._parts.get(partition)
        return part.next_commit if part else None

    def in_flight(self, partition: Hashable | None = None) -> int:
        if partition is not None:
            part = self._parts.get(partition)
            return part.in_flight if part else 0
        return sum(p.in_flight for p in self._parts.values())

    def drop(self, partition: Hashable) -> PartitionOffsets | None:
        """Forget a partition (after revocation): its unfinished work is redelivered elsewhere."""
        return self._parts.pop(partition, None)

    def partitions(self) -> list[Hashable]:
        return list(self._parts)
