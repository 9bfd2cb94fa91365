"""Every `rl.*` name the stages write into Kafka metadata: message headers and commit tags.

The one place these strings are spelled; every stage, tool and test imports them from here.

Envelope (every event, `schemas.codec.headers_for`):
    rl.schema_version      the envelope's schema version (decimal ASCII)
    rl.kind                the event's kind, e.g. "scored"
    rl.min_global_steps    versioned events: the oldest policy version behind the event
    rl.max_global_steps    versioned events: the newest one

Per topic:
    rl.trajectory_id       `rl.scored`: the trajectory a `ScoredTrajectory` completes
    rl.reward.failure      `rl.scored`: on a trajectory given the failure score (its scorer
                           failed, or the judge's verdict could not be parsed), the cause
    rl.staleness           `rl.replay` and `rl.stale`: the group's staleness
                           (`schemas.stale.staleness`) as judged by the stage that wrote it
    rl.stale.*             `rl.stale`: why a group was dropped (`schemas.stale`)
    rl.dlq.*               `rl.dlq`: where a dead letter came from and why (`schemas.deadletter`)

Commit metadata (not a header): the reward stage tags its recovery points with
`RECOVERY_POINT_TAG` (`workers.reward.ledger`).
"""

from __future__ import annotations

__all__ = [
    "DLQ_PREFIX",
    "DROPPED_PREFIX",
    "DROP_REASON",
    "DROP_TRAINER_VERSION",
    "KIND",
    "MAX_VERSION",
    "MIN_VERSION",
    "RECOVERY_POINT_TAG",
    "REWARD_FAILURE",
    "SCHEMA",
    "STALENESS",
    "TRAJECTORY_ID",
]

# The envelope.
SCHEMA = "rl.schema_version"
KIND = "rl.kind"
MIN_VERSION = "rl.min_global_steps"
MAX_VERSION = "rl.max_global_steps"

# rl.scored
TRAJECTORY_ID = "rl.trajectory_id"
REWARD_FAILURE = "rl.reward.failure"  # the cause, on failure-scored trajectories only

# rl.replay and rl.stale
STALENESS = "rl.staleness"

# rl.stale: one scheme for every stage that drops a group.
DROPPED_PREFIX = "rl.stale."
DROP_REASON = "rl.stale.reason"  # a `schemas.stale.DropReason`
DROP_TRAINER_VERSION = "rl.stale.trainer_version"  # only on the trainer's own drops

# rl.dlq: `DLQ_PREFIX` + field name (`schemas.deadletter`).
DLQ_PREFIX = "rl.dlq."

# Offset-commit metadata of the reward stage (a recovery point, not a header).
RECOVERY_POINT_TAG = "rl.scored@v1:"
