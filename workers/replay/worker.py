"""Start the replay stage: `run_worker(kafka, topics, replay)` (what `rollout worker replay` runs).

Reads the partition count of `rl.scored` from the broker, creates the stage's compacted
changelog topic with as many partitions if it is missing (and refuses one with another
count), then runs the stage until SIGTERM or SIGINT (graceful: the batch in flight finishes
and is committed) or SIGKILL (nothing is lost: uncommitted samples are redelivered and the
stage de-duplicates).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from workers.kafka.admin import prepare_stage
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.replay.config import ReplayConfig
from workers.replay.exceptions import ReplayError

if TYPE_CHECKING:
    from workers.metrics import StageMetrics

__all__ = ["run_worker"]

log = logging.getLogger("rollout.replay")


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
    partitions = prepare_stage(
        kafka,
        topics,
        source="scored",
        changelog=config.changelog_topic,
        needs=("replay", "stale", "policy", "dlq"),
        error=ReplayError,
    )
    scored = topics.name("scored")

    from workers.replay.app import ReplayStage

    stage = ReplayStage(kafka, topics, config, metrics=metrics)
    log.info(
        "replay stage %s on %s (%d partitions), n=%d", config.group_id, scored, partitions, config.n
    )
    return asyncio.run(stage.run())
