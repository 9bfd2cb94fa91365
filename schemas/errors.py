"""The project's exception root and the schema layer's errors.

RolloutError                      every error the project raises on purpose
├── DecodeError                   bytes that are not a valid event (→ dead-letter topic)
├── DuplicateUidError             a uid already naming another prompt (→ dead-letter topic)
└── (each subpackage's exceptions module adds its own)
"""

from __future__ import annotations

__all__ = ["DecodeError", "DuplicateUidError", "RolloutError"]


class RolloutError(Exception):
    """Root of every error the project raises on purpose."""


class DecodeError(RolloutError):
    """A message value that is not a valid event; carries why, for the dead-letter headers."""

    def __init__(self, message: str, *, cause: str = "invalid") -> None:
        super().__init__(message)
        self.cause = cause


class DuplicateUidError(RolloutError):
    """A prompt produced under a uid that already names another prompt downstream (its
    `content_digest` differs). Dead-lettered with cause `duplicate_uid`, never merged into
    the other prompt's trajectories or group, never dropped silently."""

    cause = "duplicate_uid"

    def __init__(self, uid: str, held: str | None, given: str | None, where: str) -> None:
        super().__init__(
            f"uid {uid} already names another prompt in {where} (content digest {held}, this "
            f"one's {given}): give distinct prompts distinct uids"
        )
        self.uid = uid
