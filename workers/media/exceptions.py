"""Errors of the media store and of reading images.

RolloutError (schemas.errors)
└── MediaError                    an image cannot be had; `cause` names why:
                                  image_missing (gone from the store), image_corrupt
                                  (the bytes no longer hash to the reference),
                                  image_unreadable (not readable or not decodable),
                                  image_too_large (past media.max_image_bytes)
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = ["MediaError"]


class MediaError(RolloutError):
    """An image cannot be read, stored or decoded; `cause` is the dead-letter reason."""

    def __init__(self, message: str, *, cause: str = "image_unreadable") -> None:
        super().__init__(message)
        self.cause = cause
