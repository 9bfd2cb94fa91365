"""`GroupTable`: the replay stage's groups and samples, over a `ChangelogTable`.

Reads come from memory (restored from the changelog on start and after every rebalance).
Writes set the entry and send the same bytes to the changelog, on the partition given (the
group's source partition), with the stage's own idempotent acks=all producer: one producer
for every write keeps the writes of one group in order, and each write returns the broker's
acknowledgement as a future. Deletes send tombstones (value None), which the restore applies
as deletions. `state` documents the keys and values.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from aiokafka import AIOKafkaProducer

from workers.kafka.changelog import ChangelogTable
from workers.replay.state import GroupState, group_key, is_group_key, sample_key

__all__ = ["GroupTable"]


class GroupTable:
    """Group headers and raw samples of the partitions this worker owns."""

    def __init__(self, store: ChangelogTable) -> None:
        self.store = store

    @property
    def producer(self) -> AIOKafkaProducer | None:
        return self.store.producer

    @producer.setter
    def producer(self, producer: AIOKafkaProducer) -> None:
        self.store.producer = producer

    def load(self, uid: str) -> GroupState | None:
        raw = self.store.get(group_key(uid))
        return GroupState.from_bytes(raw) if raw else None

    def sample(self, uid: str, index: int) -> bytes | None:
        return self.store.get(sample_key(f"{uid}/{index}"))

    def put_sample(self, uid: str, index: int, raw: bytes, partition: int) -> Awaitable[Any]:
        return self._write(sample_key(f"{uid}/{index}"), raw, partition)

    def put_group(self, state: GroupState) -> Awaitable[Any]:
        return self._write(group_key(state.uid), state.to_bytes(), state.partition)

    def delete_samples(self, state: GroupState) -> list[Awaitable[Any]]:
        return [self._write(sample_key(tid), None, state.partition) for tid in state.sample_ids()]

    def open_groups(self, partitions: frozenset[int]) -> dict[str, GroupState]:
        """Every unfinished group of `partitions`, by uid (a full scan: after rebalances only)."""
        found: dict[str, GroupState] = {}
        for key, raw, partition in self.store.items():
            if partition in partitions and is_group_key(key):
                state = GroupState.from_bytes(raw)
                if state.unfinished:
                    found[state.uid] = state
        return found

    def _write(self, key: bytes, value: bytes | None, partition: int) -> Awaitable[Any]:
        """Set (or delete) an entry; a coroutine whose result is the broker's ack future."""
        return self.store.write(key, value, partition)
