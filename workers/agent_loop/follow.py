"""What the agent-loop worker follows on other stages' topics, each from the beginning.

- `rl.policy`: the trainer's `PolicyVersion`s. `groups_trained` opens the admission gate
  (it counts everything the trainer consumed, stale drops included), `version` is the
  worker's view of the live policy.
- `rl.stale`: groups dropped before the trainer (the replay stage's drops, no trainer
  header). The trainer's own drops carry `rl.stale.trainer_version` and are skipped: the
  trainer counts those in `groups_trained` already.
- `rl.dlq`: the prompts dead-lettered by any agent-loop worker, resolved without a group (the
  gate counts the whole consumer group's prompts, so every worker's dead letters too).
- the prompts topic's committed offsets, with the started-through offset each worker commits
  as metadata: how many prompts the whole consumer group has taken (`follow_group_progress`,
  an admin client polling twice a second rather than a consumer).
- `rl.replicas`: policy replicas that register (a `ReplicaInfo`) and leave (a tombstone keyed
  by the replica id); the router adds and drops them. Judge replicas (`role: judge`, the reward
  stage's) are never added (`workers.llm.discovery`).

Each follower runs until cancelled, with its own consumer (`workers.kafka.follow`: no group,
nothing committed, an undecodable record on the policy or replicas topic logged and skipped);
the admin client comes from `workers.kafka.clients`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka.errors import KafkaError

from schemas.events import PolicyVersion
from schemas.headers import DLQ_PREFIX
from schemas.stale import is_trainer_drop
from workers.agent_loop.admission import AdmissionGate
from workers.agent_loop.offsets import OffsetTracker
from workers.kafka.clients import make_aio_admin
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.follow import events_from_beginning, records_from_beginning
from workers.llm import discovery

__all__ = [
    "follow_dead_prompts",
    "follow_group_progress",
    "follow_policy",
    "follow_replicas",
    "follow_upstream_drops",
]

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
    async for event in events_from_beginning(kafka, topics.name("policy"), client_id=client_id):
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
    async for record in records_from_beginning(kafka, topic, client_id=client_id):
        if counts(list(record.headers or ())):
            gate.observe_dropped()


async def follow_group_progress(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    gate: AdmissionGate,
    consumer: Any,
    tracker: OffsetTracker,
    *,
    group_id: str,
    client_id: str,
) -> None:
    """Feed the gate the prompts the whole group has taken, twice a second (admission.py):
    per partition, the furthest of its committed offset, the started-through offset its
    owner committed as metadata, and this worker's own start when it owns it; and the
    worker's share of the partitions."""
    topic = topics.name("prompts")
    admin = make_aio_admin(kafka, client_id=client_id)
    await admin.start()
    try:
        while True:
            try:
                offsets = await admin.list_consumer_group_offsets(group_id)
                mine = consumer.assignment()
                taken = 0
                for tp in {*offsets, *mine}:
                    if tp.topic != topic:
                        continue
                    meta = offsets.get(tp)
                    committed = (meta.offset, _started_through(meta.metadata)) if meta else (0,)
                    own = tracker.started_through(tp) if tp in mine else None
                    taken += max(*committed, own or 0)
                parts = consumer.partitions_for_topic(topic) or ()
                owned = sum(tp.topic == topic for tp in mine)
                gate.share = owned / len(parts) if parts else 1.0
                gate.observe_started(taken)
            except KafkaError as exc:  # the broker is away: keep the last count, try again
                log.debug("group progress unavailable: %r", exc)
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


def _started_through(metadata: str | None) -> int:
    """A commit's metadata as the worker writes it (the started-through offset), else 0."""
    try:
        return int(metadata or 0)
    except ValueError:
        return 0


async def follow_replicas(
    kafka: KafkaConfig, topics: TopicsConfig, router: Any, *, client_id: str
) -> None:
    """Add and remove the router's policy replicas as they register on (and leave) the topic."""
    await discovery.follow_replicas(kafka, topics, router, role="policy", client_id=client_id)
