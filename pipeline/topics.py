"""Topic admin: create, describe and delete every topic of the architecture.

Creation is idempotent (an existing topic is left as it is and reported), and each topic gets
its partitions, cleanup policy (compacted for `rl.policy` and `rl.replicas`), retention,
`min.insync.replicas` and a `max.message.bytes` large enough for long trajectories. Unless the
config sets them, the replication follows the cluster (`replication`): 3 replicas with
`min.insync.replicas` 2 on three brokers or more (production: one broker may die and every
acknowledged write is still on two), 1 and 1 on the one-broker development default. This
module only lays the topics out (`topic_layouts`); `workers.kafka.admin.ensure_topics`, the
one place that creates topics, creates them.

A command that needs topics asks `require_topics` first: a missing one is created with the
rest of the run's topics where `topics.create_missing` allows it, else `MissingTopicsError`
names `rollout topics create`. Either way the command never waits on a topic that will not
come (kafka-python would retry its metadata for a minute, then time out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import UnknownTopicOrPartitionError

from workers.kafka.admin import TopicLayout, cluster_brokers, ensure_topics, missing_topics
from workers.kafka.clients import make_admin
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.exceptions import MissingTopicsError

__all__ = [
    "create_topics",
    "creates_missing",
    "delete_topics",
    "describe_topics",
    "replication",
    "require_topics",
    "topic_configs",
    "topic_layouts",
]


def topic_configs(topics: TopicsConfig, role: str, *, brokers: int = 1) -> dict[str, str]:
    spec = topics.spec(role)
    return {
        "cleanup.policy": spec.cleanup_policy,
        "retention.ms": str(spec.retention_ms),
        "max.message.bytes": str(topics.max_message_bytes),
        "min.insync.replicas": str(topics.replication_for(brokers)[1]),
    }


def topic_layouts(
    topics: TopicsConfig, roles: Sequence[str] | None = None, *, brokers: int = 1
) -> list[TopicLayout]:
    """How each topic of `roles` (all by default) is created on a cluster of `brokers`."""
    return [
        TopicLayout(
            topics.name(role),
            topics.spec(role).partitions,
            topics.replication_for(brokers)[0],
            topic_configs(topics, role, brokers=brokers),
        )
        for role in roles or topics.ROLES
    ]


def replication(kafka: KafkaConfig, topics: TopicsConfig) -> tuple[int, int, int]:
    """(replication factor, min.insync.replicas, brokers) the run's topics get on `kafka`."""
    brokers = cluster_brokers(kafka)
    return (*topics.replication_for(brokers), brokers)


def create_topics(
    kafka: KafkaConfig, topics: TopicsConfig, roles: list[str] | None = None
) -> dict[str, str]:
    """Create the topics of `roles` (all by default); return name → 'created' | 'exists'."""
    layouts = topic_layouts(topics, roles, brokers=cluster_brokers(kafka))
    return dict(ensure_topics(kafka, layouts))


def require_topics(
    kafka: KafkaConfig, topics: TopicsConfig, roles: Sequence[str], *, create: bool = True
) -> dict[str, str]:
    """Make sure the topics of `roles` exist before a command uses them.

    If any is missing and `create` is true and `topics.create_missing` allows it on this
    cluster, every topic of the run is created, as `rollout topics create` would; the result
    is that command's (name → 'created' | 'exists'), empty when nothing was missing.
    Otherwise `MissingTopicsError` names the missing topics and the command that creates them.
    """
    missing = missing_topics(kafka, [topics.name(role) for role in roles])
    if not missing:
        return {}
    if create and creates_missing(kafka, topics):
        return create_topics(kafka, topics)
    why = "" if not create else f" (topics.create_missing={topics.create_missing})"
    raise MissingTopicsError(
        f"topic{'s' if len(missing) > 1 else ''} {', '.join(missing)} not found at "
        f"{kafka.bootstrap}{why}; `rollout topics create` creates the run's topics",
        topics=missing,
    )


def creates_missing(kafka: KafkaConfig, topics: TopicsConfig) -> bool:
    """Whether `require_topics` may create missing topics on this cluster."""
    if topics.create_missing == "local":
        return all(_is_loopback(server.rpartition(":")[0]) for server in kafka.bootstrap_servers)
    return topics.create_missing == "always"


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def describe_topics(kafka: KafkaConfig, topics: TopicsConfig) -> list[dict[str, Any]]:
    """Partitions and the configs that matter, for each of the pipeline's topics."""
    admin = make_admin(kafka)
    try:
        names = [topics.name(role) for role in topics.ROLES]
        present = set(admin.list_topics())
        rows: list[dict[str, Any]] = []
        metadata = {t["name"]: t for t in admin.describe_topics([n for n in names if n in present])}
        resources = [ConfigResource(ConfigResourceType.TOPIC, n) for n in names if n in present]
        configs: dict[str, dict[str, Any]] = {}
        if resources:
            configs = admin.describe_configs(resources).get("topic", {})
        for role, name in zip(topics.ROLES, names, strict=True):
            if name not in present:
                rows.append({"role": role, "topic": name, "exists": False})
                continue
            conf = {key: entry.get("value") for key, entry in configs.get(name, {}).items()}
            rows.append(
                {
                    "role": role,
                    "topic": name,
                    "exists": True,
                    "partitions": len(metadata[name]["partitions"]),
                    "cleanup.policy": conf.get("cleanup.policy"),
                    "retention.ms": conf.get("retention.ms"),
                    "max.message.bytes": conf.get("max.message.bytes"),
                    "replication": len(metadata[name]["partitions"][0]["replica_nodes"]),
                    "min.insync.replicas": conf.get("min.insync.replicas"),
                }
            )
        return rows
    finally:
        admin.close()


def delete_topics(
    kafka: KafkaConfig, topics: TopicsConfig, roles: list[str] | None = None
) -> list[str]:
    """Delete the pipeline's topics that exist; return the names deleted."""
    roles = roles or list(topics.ROLES)
    admin = make_admin(kafka)
    try:
        present = set(admin.list_topics())
        names = [topics.name(r) for r in roles if topics.name(r) in present]
        if names:
            try:
                admin.delete_topics(names)
            except UnknownTopicOrPartitionError:
                pass
        return names
    finally:
        admin.close()
