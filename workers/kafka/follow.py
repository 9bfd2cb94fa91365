"""Following a compacted topic (`rl.policy`, `rl.replicas`) or `rl.stale` from the beginning.

A follower reads every partition from the earliest offset with a group-less consumer that
commits nothing: no committed offset can make it skip the retained latest record, and every
reader (each worker, each replica's sync) sees every record. Records are read by one rule,
`decoded`: a tombstone is the key it deletes (when the caller wants tombstones) or nothing,
an undecodable value is logged and skipped: these topics are re-read whole on every start, so
a dead letter would be written again and again.

- `follower(kafka, *topics, client_id)`: the aiokafka consumer (subscribed to `topics`, or
  none: the caller assigns partitions);
- `tail(kafka, topic, client_id)`: the decoded records of one topic, until cancelled;
- `decoded(record)`: the rule above, also for kafka-python consumers (the replica sync).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import AIOKafkaConsumer

from schemas.codec import decode
from schemas.errors import DecodeError
from workers.kafka.config import KafkaConfig

__all__ = ["decoded", "follower", "tail"]

log = logging.getLogger("rollout.kafka.follow")


def follower(kafka: KafkaConfig, *topics: str, client_id: str) -> AIOKafkaConsumer:
    """A group-less aiokafka consumer from the earliest offset, committing nothing."""
    return AIOKafkaConsumer(
        *topics,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        client_id=client_id,
        **kafka.aiokafka_kwargs(),
    )


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


async def tail(
    kafka: KafkaConfig, topic: str, *, client_id: str, tombstones: bool = False
) -> AsyncIterator[Any]:
    """Decoded events of `topic` from the beginning; with `tombstones`, a tombstone's key."""
    consumer = follower(kafka, topic, client_id=client_id)
    await consumer.start()
    try:
        async for record in consumer:
            if (item := decoded(record, tombstones=tombstones)) is not None:
                yield item
    finally:
        await consumer.stop()
