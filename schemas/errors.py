"""The project's exception root and the schema layer's errors.

RolloutError                      every error the project raises on purpose
├── DecodeError                   bytes that are not a valid event (→ dead-letter topic)
└── (each subpackage's exceptions module adds its own)
"""

from __future__ import annotations

__all__ = ["DecodeError", "RolloutError"]


class RolloutError(Exception):
    """Root of every error the project raises on purpose."""


class DecodeError(RolloutError):
    """A message value that is not a valid event; carries why, for the dead-letter headers."""

    def __init__(self, message: str, *, cause: str = "invalid") -> None:
        super().__init__(message)
        self.cause = cause
