"""`media`: where images are stored and how big they may be."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MediaConfig"]


class MediaConfig(BaseModel):
    """The media store and the size limits of images (`rollout produce` checks them)."""

    model_config = ConfigDict(extra="forbid")

    store_dir: str = Field(
        default="~/.rollout/media",
        min_length=1,
        description="Directory of the content-addressed image store. Every stage that reads "
        "images (agent loop, trainer) must see the same path: a local directory for a local "
        "run, a shared filesystem mount (NFS, a FUSE-mounted bucket) on a cluster.",
    )
    max_image_bytes: int = Field(
        default=10 * 1024 * 1024,
        ge=1,
        description="Largest encoded image a prompt may carry; a row with a bigger one is "
        "refused at produce.",
    )
    inline_max_bytes: int = Field(
        default=0,
        ge=0,
        description="Images up to this size also travel inline (base64 in the reference), so "
        "readers need no store for them; 0 = always by reference only.",
    )
