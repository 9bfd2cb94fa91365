"""Start the replay stage: `run_worker(kafka, topics, replay)` (what `rollout worker replay` runs).

A `StageWorker` (`workers.kafka.stage_worker`): reads the partition count of `rl.scored` from
the broker, creates the stage's compacted changelog topic with as many partitions if it is
missing (and refuses one with another count), then runs the stage until SIGTERM or SIGINT
(graceful: the batch in flight finishes and is committed) or SIGKILL (nothing is lost:
uncommitted samples are redelivered and the stage de-duplicates).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.stage_worker import StageWorker
from workers.replay.config import ReplayConfig
from workers.replay.exceptions import ReplayError

if TYPE_CHECKING:
    from workers.metrics import StageMetrics
    from workers.replay.app import ReplayStage

__all__ = ["run_worker"]


def _build(
    kafka: KafkaConfig, topics: TopicsConfig, config: ReplayConfig, metrics: StageMetrics | None
) -> ReplayStage:
    from workers.replay.app import ReplayStage

    return ReplayStage(kafka, topics, config, metrics=metrics)


run_worker: StageWorker[ReplayConfig] = StageWorker(
    name="replay",
    source="scored",
    build=_build,
    error=ReplayError,
    needs=("replay", "stale", "policy", "dlq"),
)
