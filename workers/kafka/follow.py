"""The one follower of a topic from its beginning: `rl.policy`, `rl.replicas` (compacted),
`rl.stale` and `rl.dlq` (read for counts).

A `TopicFollower` reads every partition of one topic from the earliest offset with a
group-less aiokafka consumer (`workers.kafka.clients`) that commits nothing: no committed
offset can make it skip the retained latest record, and every reader (each worker, each
replica's sync, each replay worker) sees every record. Records are read by one rule,
`decoded`: a tombstone is the key it deletes (when the caller wants tombstones) or nothing,
an undecodable value is logged and skipped (`skipped` counts both): these topics are re-read
whole on every start, so a dead letter would be written again and again.

- `TopicFollower(kafka, topic, client_id=...)`: `start()` (every partition by subscription,
  or the partitions given, each from its beginning), `poll()` the decoded events (or
  `poll_records()` the records as they are), `read_to_end()` up to the end offsets there
  are now, `stop()`. With `metrics`, every record read counts as consumed from the topic.
- `events_from_beginning(...)` / `records_from_beginning(...)`: the same as an async
  iterator, from the beginning and then as records arrive, until cancelled.
- `decoded(record)`: the rule above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiokafka import TopicPartition

from schemas.codec import decode
from schemas.errors import DecodeError
from workers.kafka.clients import make_aio_consumer
from workers.kafka.config import KafkaConfig

__all__ = ["TopicFollower", "decoded", "events_from_beginning", "records_from_beginning"]

log = logging.getLogger("rollout.kafka.follow")

POLL_RECORDS = 1000


def decoded(record: Any, *, tombstones: bool = False) -> Any | None:
    """The event a record holds; a tombstone's key (with `tombstones`); else None (logged)."""
    if record.value is None:
        return record.key if tombstones and record.key is not None else None
    try:
        return decode(record.value)
    except DecodeError as exc:
        log.warning(
            "ignoring undecodable record %s[%d]@%d: %s",
            record.topic,
            record.partition,
            record.offset,
            exc,
        )
        return None


class TopicFollower:
    """One topic, every record from the beginning, nothing committed."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topic: str,
        *,
        client_id: str,
        tombstones: bool = False,
        metrics: Any = None,
    ) -> None:
        self.topic = topic
        self.tombstones = tombstones
        self.metrics = metrics  # a `workers.metrics.StageMetrics`, or None
        self.skipped = 0  # records that held no event: undecodable, or unwanted tombstones
        self._consumer = make_aio_consumer(kafka, group_id=None, client_id=client_id)
        self._partitions: list[TopicPartition] = []

    async def start(self, partitions: Iterable[int] | None = None) -> None:
        """Connect and read from the beginning: of `partitions`, or of every partition the
        topic has (subscribed: partitions the metadata shows later are read too)."""
        if partitions is None:
            self._consumer.subscribe([self.topic])
            await self._consumer.start()
            return
        await self._consumer.start()
        self._partitions = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(self._partitions)
        await self._consumer.seek_to_beginning(*self._partitions)

    async def stop(self) -> None:
        await self._consumer.stop()

    async def poll_records(self, timeout_ms: int = 1000) -> list[Any]:
        """The records that arrive within `timeout_ms` (returns as soon as there are some)."""
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=POLL_RECORDS)
        records = [r for rs in batches.values() for r in rs]
        if self.metrics is not None:
            for _ in records:
                self.metrics.consumed(self.topic)
        return records

    async def poll(self, timeout_ms: int = 1000) -> list[Any]:
        """The events (and wanted tombstones' keys) of the records `poll_records` returns."""
        events = []
        for record in await self.poll_records(timeout_ms):
            if (item := decoded(record, tombstones=self.tombstones)) is not None:
                events.append(item)
            else:
                self.skipped += 1
        return events

    async def read_to_end(self, timeout_s: float) -> list[Any]:
        """The events up to the end offsets the partitions given to `start` have now;
        `TimeoutError` when they are not read within `timeout_s`."""
        if not self._partitions:
            raise RuntimeError("read_to_end needs the partitions given to start()")
        loop = asyncio.get_running_loop()
        ends = await self._consumer.end_offsets(self._partitions)
        deadline = loop.time() + timeout_s
        events: list[Any] = []
        while [tp for tp in self._partitions if await self._consumer.position(tp) < ends[tp]]:
            if loop.time() > deadline:
                raise TimeoutError(f"could not read {self.topic} to its end")
            events += await self.poll(timeout_ms=500)
        return events


async def events_from_beginning(
    kafka: KafkaConfig, topic: str, *, client_id: str, tombstones: bool = False
) -> AsyncIterator[Any]:
    """Decoded events of `topic` from the beginning, then as they arrive, until cancelled;
    with `tombstones`, a tombstone's key (bytes)."""
    follower = TopicFollower(kafka, topic, client_id=client_id, tombstones=tombstones)
    await follower.start()
    try:
        while True:
            for item in await follower.poll():
                yield item
    finally:
        await follower.stop()


async def records_from_beginning(
    kafka: KafkaConfig, topic: str, *, client_id: str
) -> AsyncIterator[Any]:
    """The records of `topic` as they are, from the beginning, then as they arrive."""
    follower = TopicFollower(kafka, topic, client_id=client_id)
    await follower.start()
    try:
        while True:
            for record in await follower.poll_records():
                yield record
    finally:
        await follower.stop()
