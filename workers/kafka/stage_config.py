"""`StageLoopConfig`: what a consumer-group stage with a changelogged table is run by.

The reward and replay stages both run on `workers.kafka.stateful.StageLoop`; its settings
are these fields, shared, and `loop_settings()` hands them to the loop. Each stage's config
subclasses this one, overriding a default where its traffic differs (`group_id_field`,
`batch_size`, `sweep_interval_s`). Imports no Kafka client: the CLI parses configs before
anything heavy loads.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["StageLoopConfig", "group_id_field", "sweep_interval_field"]


def group_id_field(default: str) -> Any:
    """The `group_id` field with a stage's default (the run's config derives it from the topic
    prefix when it is not set: `{topics.prefix}{stage}`)."""
    return Field(
        default=default,
        min_length=1,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Consumer group id, and the prefix of the stage's changelog topic; "
        f"default in a run: `{{topics.prefix}}{default.removeprefix('rollout-')}`, so two runs "
        "(two prefixes) never share offsets or state.",
    )


def sweep_interval_field(default: float, description: str, *, le: float = 3600) -> Any:
    """The `sweep_interval_s` field with a stage's default and description."""
    return Field(default=default, gt=0, le=le, description=description)


class StageLoopConfig(BaseModel):
    """The group consumer's batching, commits and liveness, and the stage's stats file."""

    model_config = ConfigDict(extra="forbid")

    group_id: str = group_id_field("rollout-stage")
    batch_size: int = Field(default=256, ge=1, le=65536, description="Most records per batch.")
    batch_within_s: float = Field(
        default=0.2, gt=0, le=60, description="How long a batch may wait to fill once begun."
    )
    commit_interval_s: float = Field(
        default=2.8, gt=0, le=60, description="Most seconds between offset commits."
    )
    session_timeout_s: float = Field(
        default=30.0, ge=6, le=300, description="Consumer group session/rebalance timeout."
    )
    sweep_interval_s: float = sweep_interval_field(
        30.0, "With no record arriving for this long, the stage still sweeps its state."
    )
    stats_path: str | None = Field(
        default=None, description="Write the stage's counters here as JSON after each batch."
    )

    def loop_settings(self) -> dict[str, Any]:
        """The keyword arguments of `StageLoop` these settings make."""
        return {
            "group_id": self.group_id,
            "batch_size": self.batch_size,
            "batch_within_s": self.batch_within_s,
            "commit_interval_s": self.commit_interval_s,
            "session_timeout_s": self.session_timeout_s,
            "sweep_interval_s": self.sweep_interval_s,
        }
