"""Errors of the trainer package.

RolloutError
└── TrainerError
    ├── ConsumerClosedError     a TrajectoryConsumer used after close()
    ├── CheckpointError         a checkpoint cannot be read or is inconsistent
    └── PublishError            the broker did not acknowledge a PolicyVersion / stale group
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = ["CheckpointError", "ConsumerClosedError", "PublishError", "TrainerError"]


class TrainerError(RolloutError):
    """Root of the trainer package's errors."""


class ConsumerClosedError(TrainerError):
    """The consumer was used after `close()`."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be read, or does not fit the configuration."""


class PublishError(TrainerError):
    """An output of the trainer was not acknowledged by the broker."""
