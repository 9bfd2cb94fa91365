"""Errors of the weights flow.

RolloutError                        (schemas.errors)
└── WeightsError                    root of this package's errors (a publisher used wrongly)
    ├── CheckpointError             a checkpoint cannot be read or is inconsistent
    ├── PublishError                the broker did not acknowledge a PolicyVersion
    ├── TransferError               the trainer's side of broadcast transfers cannot run (its
    │                               store cannot start, or a transfer cannot be set up)
    └── WeightLoadError             weights that cannot be loaded into a served model (missing,
        │                           unexpected or misshaped tensors; a replica answers 400, its
        │                           live weights and version unchanged)
        └── WeightTransferError     broadcast weights that did not arrive (400)

The receiving side of a transfer raises torch's errors and `ValueError` inside vLLM's workers
(torch and the standard library only there); its callers translate them.
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = [
    "CheckpointError",
    "PublishError",
    "TransferError",
    "WeightLoadError",
    "WeightTransferError",
    "WeightsError",
]


class WeightsError(RolloutError):
    """Root of the weights flow's errors."""


class CheckpointError(WeightsError):
    """A checkpoint cannot be read, or does not fit the configuration."""


class PublishError(WeightsError):
    """An output of the trainer (a PolicyVersion, a stale group) was not acknowledged."""


class TransferError(WeightsError):
    """The trainer's side of weight transfers cannot run (its message says why)."""


class WeightLoadError(WeightsError):
    """Weights that do not fit the served model (missing, unexpected or misshaped)."""


class WeightTransferError(WeightLoadError):
    """Weights granted by the trainer did not arrive (it stopped answering, or dropped this
    replica after its timeout); the live weights and version are unchanged."""

    type = "weight_transfer_failed"
