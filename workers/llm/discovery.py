"""Replica discovery: a router's replicas, kept in step with the compacted `rl.replicas` topic.

`follow_replicas(kafka, topics, router, role=..., client_id=...)` reads the topic from its
beginning, then as records arrive, until cancelled (`workers.kafka.follow`: no group, nothing
committed, an undecodable record logged and skipped). A `ReplicaInfo` of `role` is added to
the router; one of another role is removed from it (an id that registered again under another
role must not stay routed to); a tombstone (the replica left cleanly) removes its id.

Both routers follow through here: the agent loops' (`policy`) and the reward stage's judge
client (`judge`), so a policy router never routes to a judge replica and the judge client
never to a policy replica, however the two pools share the topic. The router (an `LLMClient`)
refuses a replica of another role by itself as well (`workers.llm.balancer`).
"""

from __future__ import annotations

import logging
from typing import Any

from schemas.events import ReplicaInfo, ReplicaRole
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.follow import events_from_beginning

__all__ = ["follow_replicas"]

log = logging.getLogger("rollout.llm.discovery")


async def follow_replicas(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    router: Any,
    *,
    role: ReplicaRole,
    client_id: str,
) -> None:
    """Add `router`'s replicas of `role` as they register, remove them as they leave."""
    replicas = topics.name("replicas")
    async for item in events_from_beginning(kafka, replicas, client_id=client_id, tombstones=True):
        if isinstance(item, ReplicaInfo):
            if item.role == role:
                router.add_replicas([item])
            else:
                log.debug("replica %s serves %s, not %s: skipped", item.replica_id, item.role, role)
                router.remove_replicas([item.replica_id])
        elif isinstance(item, bytes):
            router.remove_replicas([item.decode()])
