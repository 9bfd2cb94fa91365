"""`ReplayConfig`: everything the replay-buffer stage is configured by, and nothing else.

Imports no Kafka client (the CLI parses it before anything heavy loads). Group size: a prompt's own
`n` travels with its samples (`ScoredTrajectory.group_size`, set by the agent-loop worker from
`PromptEvent.n` or its configured `n`); `n` here applies to samples that do not carry it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.stale import StalePolicy
from workers.kafka.stage_config import StageLoopConfig, group_id_field, sweep_interval_field

__all__ = ["PartialPolicy", "ReplayConfig", "StalePolicy"]

PartialPolicy = Literal["emit", "drop"]


class ReplayConfig(StageLoopConfig):
    """The replay-buffer stage: `rl.scored` → `TrainingGroup`s on `rl.replay` (or `rl.stale`)."""

    group_id: str = group_id_field("rollout-replay")
    batch_size: int = Field(default=256, ge=1, le=65536, description="Most samples per batch.")
    sweep_interval_s: float = sweep_interval_field(
        5.0, "With no sample arriving, how often the stage still expires groups.", le=600
    )
    n: int = Field(default=4, ge=1, le=1024, description="Group size of samples that carry none.")
    group_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="Wall seconds from a group's first sample until it is finished partial.",
    )
    partial_policy: PartialPolicy = Field(
        default="emit",
        description="A group that times out: emit what it has, or drop it to rl.stale ('timeout').",
    )
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        exclude=True,
        description="Most policy versions a group may lag (`schemas.stale.staleness`); None: "
        "any. Derived: in a run, `RunConfig` sets it to `trainer.max_staleness` (no setting "
        "of the run, left out of its dump).",
    )
    stale_policy: StalePolicy = Field(
        default="drop",
        description="Past max_staleness (the trainer's): drop to rl.stale ('stale') or keep.",
    )
    drop_zero_variance: bool = Field(
        default=False,
        description="DAPO dynamic sampling: groups whose rewards are all equal go to rl.stale.",
    )
    norm_adv_by_std: bool = Field(
        default=True, description="GRPO: divide by the group's std; False is Dr. GRPO."
    )
    adv_eps: float = Field(default=1e-6, gt=0, le=1.0, description="Added to std when dividing.")

    @model_validator(mode="after")
    def _consistent(self) -> ReplayConfig:
        if self.drop_zero_variance and self.n < 2:
            raise ValueError("drop_zero_variance needs n >= 2 (a single sample has no variance)")
        if self.sweep_interval_s > self.group_timeout_s:
            raise ValueError("sweep_interval_s must not exceed group_timeout_s")
        return self

    @property
    def changelog_topic(self) -> str:
        """The compacted topic the stage's groups are kept in (as many partitions as rl.scored)."""
        return f"{self.group_id}-groups-changelog"
