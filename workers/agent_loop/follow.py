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

Each follower runs until cancelled, with its own consumer (`workers.kafka.follow`: no group,
nothing committed, an undecodable record on the policy or replicas topic logged and skipped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from schemas.events import PolicyVersion, ReplicaInfo
from schemas.headers import DLQ_PREFIX
from schemas.stale import is_trainer_drop
from workers.agent_loop.admission import AdmissionGate
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.follow import follower, tail

__all__ = ["follow_dead_prompts", "follow_policy", "follow_replicas", "follow_upstream_drops"]

log = logging.getLogger("rollout.agent_loop.follow")

DLQ_SOURCE = DLQ_PREFIX + "topic"  # the topic a dead letter came from


async def follow_policy(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    gate: AdmissionGate,
    on_version: Callable[[int], None],
    *,
    client_id: str,
) -> None:
    """Feed the trainer's progress to the gate and each published version to `on_version`."""
    async for event in tail(kafka, topics.name("policy"), client_id=client_id):
        if isinstance(event, PolicyVersion):
            gate.observe_trained(event.groups_trained)
            on_version(event.version)


async def follow_upstream_drops(
    kafka: KafkaConfig, topics: TopicsConfig, gate: AdmissionGate, *, client_id: str
) -> None:
    """Count the groups dropped before the trainer (stale topic, no trainer header)."""
    await _count_drops(
        kafka, topics.name("stale"), gate, client_id, lambda h: not is_trainer_drop(h)
    )


async def follow_dead_prompts(
    kafka: KafkaConfig, topics: TopicsConfig, gate: AdmissionGate, *, client_id: str
) -> None:
    """Count the prompts dead-lettered by the agent-loop stage (any worker of it)."""
    prompts = topics.name("prompts").encode()
    await _count_drops(
        kafka, topics.name("dlq"), gate, client_id, lambda h: dict(h).get(DLQ_SOURCE) == prompts
    )


async def _count_drops(
    kafka: KafkaConfig,
    topic: str,
    gate: AdmissionGate,
    client_id: str,
    counts: Callable[[list[tuple[str, bytes]]], bool],
) -> None:
    """Tell the gate of every record of `topic` whose headers `counts`, from the beginning."""
    consumer = follower(kafka, topic, client_id=client_id)
    await consumer.start()
    try:
        async for record in consumer:
            if counts(list(record.headers or ())):
                gate.observe_dropped()
    finally:
        await consumer.stop()


async def follow_replicas(
    kafka: KafkaConfig, topics: TopicsConfig, router: Any, *, client_id: str
) -> None:
    """Add and remove the router's replicas as they register on (and leave) the topic."""
    async for item in tail(kafka, topics.name("replicas"), client_id=client_id, tombstones=True):
        if isinstance(item, ReplicaInfo):
            router.add_replicas([item])
        elif isinstance(item, bytes):
            router.remove_replicas([item.decode()])
