"""Turn the images a user gave (`image_url` parts) into references in the media store.

`ingest_prompt` reads each `image_url` part of a prompt (a `data:` URI, a file path or
`file://` URL, an http(s) URL), refuses an image past `media.max_image_bytes` or one Pillow
cannot decode, stores it (`MediaStore.put`) and puts an `image_ref` part in its place; text
parts and `image_ref` parts stay as they are. Every refusal is one `MediaError` line that
names the image and, for size, the setting. Nothing here talks to Kafka: `rollout produce`
calls it on each row before the row is sent.
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from schemas.events import PromptEvent
from schemas.media import ImageRefPart, ImageUrlPart
from workers.media.config import MediaConfig
from workers.media.exceptions import MediaError
from workers.media.store import MediaStore, decode_image, mime_type_of

__all__ = ["Ingestor", "ingest_prompt", "read_image_url"]

_FETCH_TIMEOUT_S = 30.0


def _too_large(size: int | str, limit: int) -> MediaError:
    return MediaError(f"{size} bytes, over media.max_image_bytes={limit}", cause="image_too_large")


def read_image_url(url: str, max_bytes: int) -> bytes:
    """The bytes an `image_url` names, at most `max_bytes` of them."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise MediaError("a data: URI must be data:<mime>;base64,<bytes>")
        if len(payload) * 3 // 4 > max_bytes + 3:  # refuse before decoding a huge payload
            raise _too_large(f"about {len(payload) * 3 // 4}", max_bytes)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"the data: URI is not valid base64 ({exc})") from exc
    elif url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as response:
                data = response.read(max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise MediaError(f"cannot fetch {url}: {exc}") from exc
        if len(data) > max_bytes:
            raise _too_large(f"more than {max_bytes}", max_bytes)
    else:
        path = Path(
            urllib.parse.unquote(url[len("file://") :]) if url.startswith("file://") else url
        )
        try:
            size = path.stat().st_size
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            data = path.read_bytes()
        except OSError as exc:
            raise MediaError(f"cannot read image file {path}: {exc.strerror or exc}") from exc
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes)
    if not data:
        raise MediaError("the image is empty")
    return data


def ingest_prompt(event: PromptEvent, store: MediaStore, *, max_image_bytes: int) -> PromptEvent:
    """`event` with each `image_url` part read, checked, stored and made an `image_ref` part
    (the event itself when it has none). `MediaError` names the first image that fails."""
    changed = False
    messages = []
    count = 0
    for m_index, message in enumerate(event.prompt):
        if isinstance(message.content, str):
            messages.append(message)
            continue
        parts = []
        for part in message.content:
            if isinstance(part, ImageUrlPart):
                try:
                    data = read_image_url(part.image_url.url, max_image_bytes)
                    decode_image(data)
                    ref = store.put(data, mime_type_of(data))
                except MediaError as exc:
                    raise MediaError(
                        f"prompt.{m_index} image {count}: {exc}", cause=exc.cause
                    ) from exc
                parts.append(ImageRefPart(image_ref=ref))
                changed = True
            else:
                parts.append(part)
            count += part.type != "text"
        messages.append(message.model_copy(update={"content": parts}))
    return event.model_copy(update={"prompt": messages}) if changed else event


class Ingestor:
    """`ingest_prompt` with the run's `media` settings: the store and the size limit."""

    def __init__(self, config: MediaConfig) -> None:
        self.store = MediaStore(config.store_dir, inline_max_bytes=config.inline_max_bytes)
        self.max_image_bytes = config.max_image_bytes

    def __call__(self, event: PromptEvent) -> PromptEvent:
        return ingest_prompt(event, self.store, max_image_bytes=self.max_image_bytes)
