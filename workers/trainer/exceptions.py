"""Errors of the trainer package.

RolloutError
└── TrainerError
    ├── ConsumerClosedError     a TrajectoryConsumer used after close()
    ├── DeviceError             the configured training device is not there
    ├── RunFinishedError        the run's latest checkpoint is already at `max_steps`
    └── RouterReplayError       routing replay does not fit the model (dense, another router
                                kind, routing recorded by a model of another shape)

`CheckpointError` and `PublishError` (a checkpoint that cannot be read; an output the broker
did not acknowledge) are the weights flow's (`workers.weights.exceptions`), named here too.
"""

from __future__ import annotations

from schemas.errors import RolloutError
from workers.weights.exceptions import CheckpointError, PublishError

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


class DeviceError(TrainerError):
    """`trainer.device` names a device this machine does not have."""


class RouterReplayError(TrainerError):
    """`trainer.router_replay` or a batch's recorded routing does not fit the trained model."""


class RunFinishedError(TrainerError):
    """The run's latest checkpoint is already at `trainer.max_steps`: nothing to train."""
