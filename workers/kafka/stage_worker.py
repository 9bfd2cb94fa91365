"""`StageWorker`: the `run_worker(kafka, topics, config)` of a stage with a changelogged table.

One definition of what `rollout worker reward` and `rollout worker replay` run: check the
stage's config, read the partition count of its source topic from the broker (once the topics
it `needs` are known to exist), create its compacted changelog topic with as many partitions
if it is missing (and refuse one with another count), build the stage, then run it until
SIGTERM or SIGINT (graceful: the batch in flight finishes and is committed) or SIGKILL
(nothing is lost: uncommitted records are redelivered and the stage de-duplicates).

Imports no stage: each stage's `worker` module names its own `StageWorker`, whose `build`
imports the stage's app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from schemas.errors import RolloutError
from workers.kafka.admin import prepare_stage
from workers.kafka.config import KafkaConfig, TopicsConfig

if TYPE_CHECKING:
    from workers.metrics import StageMetrics

__all__ = ["Stage", "StageWorker"]


class _StageConfig(Protocol):
    @property
    def group_id(self) -> str: ...

    @property
    def changelog_topic(self) -> str: ...


class Stage(Protocol):
    """A built stage: `run()` serves it until it is stopped; the exit status."""

    async def run(self) -> int: ...


C = TypeVar("C", bound=_StageConfig)


def _nothing_missing(config: object) -> str | None:
    return None


@dataclass(frozen=True)
class StageWorker(Generic[C]):
    """How one stage starts; calling it runs the stage in this process."""

    name: str  # the stage: its logger is `rollout.<name>`
    source: str  # the role of the topic it consumes (its changelog has as many partitions)
    build: Callable[[KafkaConfig, TopicsConfig, C, StageMetrics | None], Stage]
    error: type[RolloutError]  # what a missing topic or a config that cannot start raises
    needs: tuple[str, ...] = ()  # roles of the other topics that must exist before it starts
    check: Callable[[C], str | None] = _nothing_missing  # what the config lacks to start

    def __call__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        config: C,
        *,
        metrics: StageMetrics | None = None,
    ) -> int:
        """Run the stage in this process until it is stopped; the exit status.

        `metrics`: the process's `StageMetrics(name)` (served by the caller), else its own.
        """
        missing = self.check(config)
        if missing:
            raise self.error(missing)
        partitions = prepare_stage(
            kafka,
            topics,
            source=self.source,
            changelog=config.changelog_topic,
            group=config.group_id,
            needs=self.needs,
            error=self.error,
        )
        stage = self.build(kafka, topics, config, metrics)
        logging.getLogger(f"rollout.{self.name}").info(
            "%s stage %s on %s (%d partitions)",
            self.name,
            config.group_id,
            topics.name(self.source),
            partitions,
        )
        return asyncio.run(stage.run())
