"""What the agent-loop worker follows on other stages' topics, each from the beginning.

- `rl.policy`: the trainer's `PolicyVersion`s. `groups_trained` opens the admission gate
  (it counts everything the trainer consumed, stale drops included), `version` is the
  worker's view of the live policy.
- `rl.stale`: groups dropped before the trainer (the replay stage's drops, no trainer
  header). The trainer's own drops carry `rl.stale.trainer_version` and are skipped: the
  trainer counts those in `groups_trained` already.
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
from schemas.stale import is_trainer_drop
from workers.agent_loop.admission import AdmissionGate
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.follow import follower, tail

__all__ = ["follow_policy", "follow_replicas", "follow_upstream_drops"]

log = logging.getLogger("rollout.agent_loop.follow")


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
    consumer = follower(kafka, topics.name("stale"), client_id=client_id)
    await consumer.start()
    try:
        async for record in consumer:
            if not is_trainer_drop(record.headers):
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
