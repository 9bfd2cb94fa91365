"""`MediaStore`: images kept under the SHA-256 of their bytes, in a directory.

Contract:
- `put(bytes)` writes `<root>/<sha[:2]>/<sha>` once (write to a temporary name, then rename:
  a reader never sees half an image) and returns the `ImageRef`; putting the same bytes
  again writes nothing;
- `get(ref)` returns the bytes: the reference's inline `data` when it has some, else the
  store's file. A file that is gone raises `MediaError(cause="image_missing")`, bytes that
  no longer hash to the reference `image_corrupt`: a reader never trains on another image;
- `decode(bytes)` is the image as RGB pixels (Pillow), `image_unreadable` when it is none.

On a cluster `root` is a path every stage mounts (a shared filesystem or a mounted bucket);
nothing here assumes one process or one host.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import uuid
from pathlib import Path
from typing import Any

from schemas.media import ImageRef
from workers.media.exceptions import MediaError

__all__ = ["MediaStore", "decode_image", "mime_type_of"]


class MediaStore:
    """A content-addressed directory of images."""

    def __init__(self, root: str | Path, *, inline_max_bytes: int = 0) -> None:
        self.root = Path(root).expanduser()
        self.inline_max_bytes = inline_max_bytes

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def put(self, data: bytes, mime_type: str) -> ImageRef:
        sha = hashlib.sha256(data).hexdigest()
        target = self.path(sha)
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{sha}.{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        inline = base64.b64encode(data).decode() if len(data) <= self.inline_max_bytes else None
        return ImageRef(sha256=sha, mime_type=mime_type, size=len(data), data=inline)

    def get(self, ref: ImageRef) -> bytes:
        if ref.data is not None:
            try:
                data = base64.b64decode(ref.data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise MediaError(
                    f"image {ref.sha256[:12]}: its inline data is not base64 ({exc})",
                    cause="image_unreadable",
                ) from exc
        else:
            try:
                data = self.path(ref.sha256).read_bytes()
            except FileNotFoundError as exc:
                raise MediaError(
                    f"image {ref.sha256[:12]} is not in the media store {self.root} "
                    "(removed, or media.store_dir differs between stages)",
                    cause="image_missing",
                ) from exc
            except OSError as exc:
                raise MediaError(
                    f"image {ref.sha256[:12]}: cannot read {self.path(ref.sha256)}: {exc}",
                    cause="image_unreadable",
                ) from exc
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise MediaError(
                f"image {ref.sha256[:12]}: the bytes read do not hash to the reference",
                cause="image_corrupt",
            )
        return data


def decode_image(data: bytes) -> Any:
    """The image as a fully loaded RGB `PIL.Image.Image`; `MediaError` when it is none."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: a truncated file fails here, not in a later stage
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise MediaError(f"not a decodable image: {exc}", cause="image_unreadable") from exc


def mime_type_of(data: bytes) -> str:
    """The MIME type of an encoded image by its content (`MediaError` if not an image)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format or ""
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise MediaError(f"not a decodable image: {exc}", cause="image_unreadable") from exc
    return Image.MIME.get(fmt, f"image/{fmt.lower() or 'unknown'}")
