"""Errors of the trainer package.

RolloutError
└── TrainerError
    ├── ConsumerClosedError     a TrajectoryConsumer used after close()
    ├── CheckpointError         a checkpoint cannot be read or is inconsistent
    ├── DeviceError             the configured training device is not there
    ├── PublishError            the broker did not acknowledge a PolicyVersion / stale group
    ├── RunFinishedError        the run's latest checkpoint is already at `max_steps`
    └── RouterReplayError       routing replay does not fit the model (dense, another router
                                kind, routing recorded by a model of another shape)
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = [
    "CheckpointError",
    "ConsumerClosedError",
    "DeviceError",
    "PublishError",
    "RouterReplayError",
    "RunFinishedError",
    "TrainerError",
]


class TrainerError(RolloutError):
    """Root of the trainer package's errors."""


class ConsumerClosedError(TrainerError):
    """The consumer was used after `close()`."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be read, or does not fit the configuration."""


class DeviceError(TrainerError):
    """`trainer.device` names a device this machine does not have."""


class PublishError(TrainerError):
    """An output of the trainer was not acknowledged by the broker."""


class RouterReplayError(TrainerError):
    """`trainer.router_replay` or a batch's recorded routing does not fit the trained model."""


class RunFinishedError(TrainerError):
    """The run's latest checkpoint is already at `trainer.max_steps`: nothing to train."""
