"""What the pipeline asks the broker about topics, and the one place that creates them.

- `ensure_topics(kafka, layouts)`: creates those of the `TopicLayout`s the cluster lacks;
  every topic of the pipeline is created through it (`pipeline.topics` for the run's topics,
  `ensure_changelog` for a stage's changelog, the benchmarks for their scratch topics). An
  existing topic is left as it is; one another process creates meanwhile counts as created.
- `missing_topics`, `topic_partitions`: what exists, and with how many partitions.
- `cluster_brokers(kafka)`: how many brokers the cluster has, which sets the replication of
  topics whose `TopicsConfig` leaves it unset (`TopicsConfig.replication_for`).
- `ensure_changelog(kafka, topics, name, partitions)` creates a stage's compacted changelog
  topic with as many partitions as its source topic (a key's state lives on the changelog
  partition of its source partition), and refuses one that exists with another count: the
  state in it would no longer line up with the source partitions.
- `group_offsets(kafka, group)`, `group_topics(kafka, group)`: what a consumer group has
  committed, and on which topics.
- `prepare_stage`: all of that for a stateful stage before it starts, and the refusal of a
  group (so a changelog) that already served another run's topics: its state would drop this
  run's records as already done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kafka.admin import NewTopic
from kafka.errors import (
    CoordinatorLoadInProgressError,
    CoordinatorNotAvailableError,
    NotCoordinatorError,
    TopicAlreadyExistsError,
)

from schemas.errors import RolloutError
from workers.kafka.clients import make_admin
from workers.kafka.config import KafkaConfig, TopicsConfig

__all__ = [
    "TopicLayout",
    "cluster_brokers",
    "ensure_changelog",
    "ensure_topics",
    "group_offsets",
    "group_topics",
    "missing_topics",
    "prepare_stage",
    "topic_partitions",
]

log = logging.getLogger("rollout.kafka.admin")

#: A group's coordinator is being made, loaded or moved: asked again, never fatal.
_COORDINATOR_MOVING = (
    CoordinatorNotAvailableError,
    CoordinatorLoadInProgressError,
    NotCoordinatorError,
)


@dataclass(frozen=True, slots=True)
class TopicLayout:
    """A topic to create: its partitions, replication factor and topic-level configs."""

    name: str
    partitions: int
    replication_factor: int = 1
    configs: Mapping[str, str] = field(default_factory=dict)


def ensure_topics(
    kafka: KafkaConfig, layouts: Sequence[TopicLayout]
) -> dict[str, Literal["created", "exists"]]:
    """Create those of `layouts` the cluster does not have, waiting until their metadata is
    there; name → 'created' | 'exists' (an existing topic's layout is not compared)."""
    admin = make_admin(kafka)
    try:
        existing = set(admin.list_topics())
        outcome: dict[str, Literal["created", "exists"]] = {}
        new = []
        for layout in layouts:
            if layout.name in existing:
                outcome[layout.name] = "exists"
                continue
            new.append(
                NewTopic(
                    layout.name,
                    num_partitions=layout.partitions,
                    replication_factor=layout.replication_factor,
                    topic_configs=dict(layout.configs),
                )
            )
        if new:
            try:
                admin.create_topics(new, wait_for_metadata=True)
            except TopicAlreadyExistsError:
                pass  # raced with another creator: fine, the topic exists
            for topic in new:
                outcome[topic.name] = "created"
                log.info("created topic %s (%d partitions)", topic.name, topic.num_partitions)
        return outcome
    finally:
        admin.close()


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


def cluster_brokers(kafka: KafkaConfig) -> int:
    """The brokers of the cluster (fenced ones too: a broker down for a moment is a member)."""
    admin = make_admin(kafka)
    try:
        return len(admin.describe_cluster().get("brokers", [])) or 1
    finally:
        admin.close()


def ensure_changelog(kafka: KafkaConfig, topics: TopicsConfig, name: str, partitions: int) -> None:
    """Create the compacted changelog `name` with `partitions` partitions if it is missing,
    replicated as the run's topics are (a stage's state survives what its input survives)."""
    existing = topic_partitions(kafka, name)
    if existing is None:
        replicas, isr = topics.replication_for(cluster_brokers(kafka))
        configs = {
            "cleanup.policy": "compact",
            "max.message.bytes": str(topics.max_message_bytes),
            "min.insync.replicas": str(isr),
        }
        ensure_topics(kafka, [TopicLayout(name, partitions, replicas, configs)])
        # On a cluster a new topic reaches every broker's metadata a moment after the one
        # that created it answered: a stage asked another broker and found none (it exited).
        deadline = time.monotonic() + 30
        while (existing := topic_partitions(kafka, name)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
    if existing != partitions:
        raise RolloutError(
            f"changelog topic {name} has {existing} partitions, its source topic {partitions}"
        )


def group_offsets(kafka: KafkaConfig, group: str, *, wait_s: float = 30.0) -> dict[Any, Any]:
    """The committed offsets of the consumer group `group` (TopicPartition → OffsetAndMetadata;
    empty for a new group). A broker that has not yet made its offsets topic (the first group
    a fresh cluster sees) answers "coordinator not available" for a few seconds: asked again
    for up to `wait_s`."""
    admin = make_admin(kafka)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                return dict(admin.list_group_offsets({group: None}).get(group, {}))
            except _COORDINATOR_MOVING:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        admin.close()


def group_topics(kafka: KafkaConfig, group: str) -> set[str]:
    """The topics the consumer group `group` has committed offsets on (none: a new group)."""
    return {tp.topic for tp, at in group_offsets(kafka, group).items() if at.offset >= 0}


def prepare_stage(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    *,
    source: str,
    changelog: str,
    group: str,
    needs: Sequence[str] = (),
    error: type[RolloutError] = RolloutError,
) -> int:
    """Before a stateful stage starts: the partitions of its `source` role's topic, once the
    topics of `needs` (roles) are known to exist and its `changelog` has as many partitions.
    `error(message)` for a topic that does not exist, or for a `group` that has consumed
    other topics than this run's source: its changelog holds another run's state."""
    counts = {role: topic_partitions(kafka, topics.name(role)) for role in (source, *needs)}
    for role, count in counts.items():
        if count is None:
            raise error(f"topic {topics.name(role)} does not exist (run `rollout topics create`)")
    source_topic = topics.name(source)
    if others := sorted(group_topics(kafka, group) - {source_topic}):
        raise error(
            f"consumer group {group} already consumed {', '.join(others)} (another run's "
            f"topics), so its changelog {changelog} holds that run's state and would drop "
            f"{source_topic}'s records as done; leave the stage's group_id unset (it follows "
            "topics.prefix) or name a new one"
        )
    partitions = counts[source]
    assert partitions is not None
    ensure_changelog(kafka, topics, changelog, partitions)
    return partitions
