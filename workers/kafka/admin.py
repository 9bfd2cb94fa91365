"""What a stage asks the broker before it starts: missing topics, a topic's partition count,
its changelog topic.

`ensure_changelog(kafka, topics, name, partitions)` creates a stage's compacted changelog
topic with as many partitions as its source topic (a key's state lives on the changelog
partition of its source partition), and refuses one that exists with another count: the
state in it would no longer line up with the source partitions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from schemas.errors import RolloutError
from workers.kafka.clients import make_admin
from workers.kafka.config import KafkaConfig, TopicsConfig

__all__ = ["ensure_changelog", "missing_topics", "prepare_stage", "topic_partitions"]

log = logging.getLogger("rollout.kafka.admin")


def missing_topics(kafka: KafkaConfig, names: Sequence[str]) -> list[str]:
    """Those of `names` that the cluster does not have (one metadata request)."""
    admin = make_admin(kafka)
    try:
        present = set(admin.list_topics())
    finally:
        admin.close()
    return [name for name in names if name not in present]


def topic_partitions(kafka: KafkaConfig, topic: str) -> int | None:
    """Partitions of `topic` on the broker; None if it does not exist."""
    admin = make_admin(kafka)
    try:
        if topic not in set(admin.list_topics()):
            return None
        described = admin.describe_topics([topic])
    finally:
        admin.close()
    for entry in described:
        if entry.get("name", entry.get("topic")) == topic and entry.get("partitions"):
            return len(entry["partitions"])
    return None


def ensure_changelog(kafka: KafkaConfig, topics: TopicsConfig, name: str, partitions: int) -> None:
    """Create the compacted changelog `name` with `partitions` partitions if it is missing."""
    existing = topic_partitions(kafka, name)
    if existing is None:
        admin = make_admin(kafka)
        try:
            configs = {
                "cleanup.policy": "compact",
                "max.message.bytes": str(topics.max_message_bytes),
                "min.insync.replicas": str(topics.min_insync_replicas),
            }
            admin.create_topics(
                [NewTopic(name, partitions, topics.replication_factor, topic_configs=configs)],
                wait_for_metadata=True,
            )
            log.info("created changelog topic %s (%d partitions)", name, partitions)
        except TopicAlreadyExistsError:
            pass  # raced with another worker of the stage
        finally:
            admin.close()
        existing = topic_partitions(kafka, name)
    if existing != partitions:
        raise RolloutError(
            f"changelog topic {name} has {existing} partitions, its source topic {partitions}"
        )


def prepare_stage(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    *,
    source: str,
    changelog: str,
    needs: Sequence[str] = (),
    error: type[RolloutError] = RolloutError,
) -> int:
    """Before a stateful stage starts: the partitions of its `source` role's topic, once the
    topics of `needs` (roles) are known to exist and its `changelog` has as many partitions.
    `error(message)` for a topic that does not exist."""
    counts = {role: topic_partitions(kafka, topics.name(role)) for role in (source, *needs)}
    for role, count in counts.items():
        if count is None:
            raise error(f"topic {topics.name(role)} does not exist (run `rollout topics create`)")
    partitions = counts[source]
    assert partitions is not None
    ensure_changelog(kafka, topics, changelog, partitions)
    return partitions
