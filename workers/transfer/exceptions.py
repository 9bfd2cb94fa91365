"""Errors of the weight-transfer plumbing (the trainer's side; the receiving side raises
torch's and `ValueError`, translated by its callers).

RolloutError                  (schemas.errors)
└── TransferError             the rendezvous store cannot start, or a transfer cannot be set up
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = ["TransferError"]


class TransferError(RolloutError):
    """The trainer's side of weight transfers cannot run (its message says why)."""
