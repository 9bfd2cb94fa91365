"""Start the replay stage: `run_worker(kafka, topics, replay)` (what `rollout worker replay` runs).

Reads the partition count of `rl.scored` from the broker (the table's changelog and the tick
topic must have as many), creates the stage's tick topic if it is missing (short retention;
refuses one with another partition count), then runs the faust worker until SIGTERM or SIGINT
(graceful: the batch in flight finishes and is committed) or SIGKILL (nothing is lost:
uncommitted samples are redelivered and the stage de-duplicates).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from workers.kafka.clients import make_admin
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.replay.config import ReplayConfig
from workers.replay.exceptions import ReplayError

if TYPE_CHECKING:
    from workers.metrics import StageMetrics

__all__ = ["ensure_tick_topic", "run_worker", "topic_partitions"]

log = logging.getLogger("rollout.replay")

TICK_RETENTION_MS = 3600 * 1000


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


def ensure_tick_topic(kafka: KafkaConfig, topics: TopicsConfig, name: str, partitions: int) -> None:
    """Create the tick topic with `partitions` partitions; `ReplayError` if it has others."""
    existing = topic_partitions(kafka, name)
    if existing is None:
        admin = make_admin(kafka)
        try:
            admin.create_topics(
                [
                    NewTopic(
                        name,
                        num_partitions=partitions,
                        replication_factor=topics.replication_factor,
                        topic_configs={
                            "cleanup.policy": "delete",
                            "retention.ms": str(TICK_RETENTION_MS),
                            "min.insync.replicas": str(topics.min_insync_replicas),
                        },
                    )
                ],
                wait_for_metadata=True,
            )
            log.info("created tick topic %s (%d partitions)", name, partitions)
        except TopicAlreadyExistsError:
            pass  # raced with another worker of the stage
        finally:
            admin.close()
        existing = topic_partitions(kafka, name)
    if existing != partitions:
        raise ReplayError(
            f"tick topic {name} has {existing} partitions, the scored topic {partitions}: "
            "delete it (it holds only wake-ups) and restart"
        )


def run_worker(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    config: ReplayConfig,
    *,
    metrics: StageMetrics | None = None,
) -> int:
    """Run the replay stage in this process until it is stopped; the exit status.

    `metrics`: the process's `StageMetrics("replay")` (served by the caller), else its own.
    """
    scored = topics.name("scored")
    partitions = topic_partitions(kafka, scored)
    if partitions is None:
        raise ReplayError(f"topic {scored} does not exist (run `rollout topics create`)")
    for role in ("replay", "stale", "policy", "dlq"):
        if topic_partitions(kafka, topics.name(role)) is None:
            raise ReplayError(
                f"topic {topics.name(role)} does not exist (run `rollout topics create`)"
            )
    ensure_tick_topic(kafka, topics, config.tick_topic, partitions)

    from workers.replay.app import ReplayStage

    stage = ReplayStage(kafka, topics, config, source_partitions=partitions, metrics=metrics)
    log.info(
        "replay stage %s on %s (%d partitions), n=%d", config.app_id, scored, partitions, config.n
    )
    from workers.kafka.faust_app import run_faust_app

    return run_faust_app(stage.app)
