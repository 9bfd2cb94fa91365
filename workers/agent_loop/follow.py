"""What the agent-loop worker follows on other stages' topics, each from the beginning.

- `rl.policy`: the trainer's `PolicyVersion`s. `groups_trained` opens the admission gate
  (it counts everything the trainer consumed, stale drops included), `version` is the
  worker's view of the live policy.
- `rl.stale`: groups dropped before the trainer (the replay stage's drops, no trainer
  header). The trainer's own drops carry `rl.stale.trainer_version` and are skipped: the
  trainer counts those in `groups_trained` already.
- `rl.dlq`: the prompts dead-lettered by any agent-loop worker, resolved without a group (the
  gate counts the whole consumer group's prompts, so every worker's dead letters too).
- `rl.replicas`: replicas that register (a `ReplicaInfo`) and leave (a tombstone keyed by
  the replica id); the router adds and drops them.

Each follower runs until cancelled, with its own consumer (no group, nothing committed). An
undecodable record on the policy or replicas topic is logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer

from schemas.codec import decode
from schemas.deadletter import DLQ_HEADER_PREFIX
from schemas.errors import DecodeError
from schemas.events import PolicyVersion, ReplicaInfo
from workers.agent_loop.admission import AdmissionGate
from workers.kafka.config import KafkaConfig, TopicsConfig

__all__ = [
    "TRAINER_STALE_HEADER",
    "follow_dead_prompts",
    "follow_policy",
    "follow_replicas",
    "follow_upstream_drops",
]

log = logging.getLogger("rollout.agent_loop.follow")

# Set by the trainer on the groups it drops (it counts those in `groups_trained` already).
TRAINER_STALE_HEADER = "rl.stale.trainer_version"


async def follow_policy(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    gate: AdmissionGate,
    on_version: Callable[[int], None],
    *,
    client_id: str,
) -> None:
    """Feed the trainer's progress to the gate and each published version to `on_version`."""
    async for event in _tail(kafka, topics.name("policy"), client_id=client_id):
        if isinstance(event, PolicyVersion):
            gate.observe_trained(event.groups_trained)
            on_version(event.version)


async def follow_upstream_drops(
    kafka: KafkaConfig, topics: TopicsConfig, gate: AdmissionGate, *, client_id: str
) -> None:
    """Count the groups dropped before the trainer (stale topic, no trainer header)."""
    consumer = _consumer(kafka, topics.name("stale"), client_id=client_id)
    await consumer.start()
    try:
        async for record in consumer:
            if not any(key == TRAINER_STALE_HEADER for key, _ in record.headers or ()):
                gate.observe_dropped()
    finally:
        await consumer.stop()


async def follow_dead_prompts(
    kafka: KafkaConfig, topics: TopicsConfig, gate: AdmissionGate, *, client_id: str
) -> None:
    """Count the prompts dead-lettered by the agent-loop stage (any worker of it)."""
    prompts = topics.name("prompts").encode()
    consumer = _consumer(kafka, topics.name("dlq"), client_id=client_id)
    await consumer.start()
    try:
        async for record in consumer:
            headers = dict(record.headers or ())
            if headers.get(DLQ_HEADER_PREFIX + "topic") == prompts:
                gate.observe_dropped()
    finally:
        await consumer.stop()


async def follow_replicas(
    kafka: KafkaConfig, topics: TopicsConfig, router: Any, *, client_id: str
) -> None:
    """Add and remove the router's replicas as they register on (and leave) the topic."""
    async for item in _tail(kafka, topics.name("replicas"), client_id=client_id, tombstones=True):
        if isinstance(item, ReplicaInfo):
            router.add_replicas([item])
        elif isinstance(item, bytes):
            router.remove_replicas([item.decode()])


def _consumer(kafka: KafkaConfig, topic: str, *, client_id: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        topic, group_id=None, auto_offset_reset="earliest", enable_auto_commit=False,
        client_id=client_id, **kafka.aiokafka_kwargs(),
    )  # fmt: skip


async def _tail(
    kafka: KafkaConfig, topic: str, *, client_id: str, tombstones: bool = False
) -> AsyncIterator[Any]:
    """Decoded events of `topic` from the beginning; with `tombstones`, a tombstone's key."""
    consumer = _consumer(kafka, topic, client_id=client_id)
    await consumer.start()
    try:
        async for record in consumer:
            if record.value is None:
                if tombstones and record.key is not None:
                    yield record.key
                continue
            try:
                yield decode(record.value)
            except DecodeError as exc:
                log.warning("ignoring undecodable record on %s: %s", topic, exc)
    finally:
        await consumer.stop()
