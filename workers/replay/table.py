"""`GroupTable`: the replay stage's faust table, read from memory, written through one producer.

Reads come from faust's in-memory store (recovered from the changelog on start and after
every rebalance). Writes set the store and send the same bytes to the table's changelog, on
the partition given (the group's source partition), with the stage's own idempotent acks=all
producer, never with faust's `table[k] = v` (which needs a current event and buffers the
send). One producer for every write keeps the writes of one group in order, and each write
returns the broker's acknowledgement as a future. Deletes send tombstones (value None), which
faust's recovery applies as deletions. `state` documents the keys and values.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from aiokafka import AIOKafkaProducer

from workers.replay.state import GroupState, group_key, is_group_key, sample_key

__all__ = ["GroupTable"]


class GroupTable:
    """Group headers and raw samples of the partitions this worker owns."""

    def __init__(self, table: Any) -> None:
        self._table = table
        self.changelog: str = table.changelog_topic.get_topic_name()
        self.producer: AIOKafkaProducer | None = None

    def load(self, uid: str) -> GroupState | None:
        raw = self._table.data.get(group_key(uid))
        return GroupState.from_bytes(raw) if raw else None

    def sample(self, uid: str, index: int) -> bytes | None:
        raw: bytes | None = self._table.data.get(sample_key(f"{uid}/{index}"))
        return raw

    def put_sample(self, uid: str, index: int, raw: bytes, partition: int) -> Awaitable[Any]:
        return self._write(sample_key(f"{uid}/{index}"), raw, partition)

    def put_group(self, state: GroupState) -> Awaitable[Any]:
        return self._write(group_key(state.uid), state.to_bytes(), state.partition)

    def delete_samples(self, state: GroupState) -> list[Awaitable[Any]]:
        return [self._write(sample_key(tid), None, state.partition) for tid in state.sample_ids()]

    def open_groups(self, partitions: frozenset[int]) -> dict[str, GroupState]:
        """Every unfinished group of `partitions`, by uid (a full scan: after rebalances only)."""
        found: dict[str, GroupState] = {}
        for key, raw in list(self._table.data.items()):
            if raw and is_group_key(key):
                state = GroupState.from_bytes(raw)
                if state.unfinished and state.partition in partitions:
                    found[state.uid] = state
        return found

    def _write(self, key: bytes, value: bytes | None, partition: int) -> Awaitable[Any]:
        """Set (or delete) an entry; a coroutine whose result is the broker's ack future."""
        assert self.producer is not None
        if value is None:
            self._table.data.pop(key, None)
        else:
            self._table.data[key] = value
        return self.producer.send(self.changelog, value, key=key, partition=partition)
