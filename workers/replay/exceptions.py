"""Errors of the replay stage.

RolloutError
└── ReplayError                 the stage cannot start or run (a missing topic)
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = ["ReplayError"]


class ReplayError(RolloutError):
    """The replay stage cannot start or run as configured."""
