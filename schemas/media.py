"""Images in chat messages: the content parts of a message and the reference to an image.

A message's `content` is a string or a list of parts, in the OpenAI shape:
- `{"type": "text", "text": ...}`;
- `{"type": "image_url", "image_url": {"url": ...}}` with a `data:` URI, a file path
  (`file://` or plain) or an http(s) URL: what a user writes, accepted on `rl.prompts` only
  until `rollout produce` (or `workers.media.ingest`) has turned it into a reference;
- `{"type": "image_ref", "image_ref": {...}}`: an `ImageRef`, what every event carries.

Invariants:
- an `ImageRef` names its image by the SHA-256 of the image's bytes: the media store keeps
  the bytes under that name (content-addressed: the same image is stored once, and a file
  that changed is detected on read), so events carry a few dozen bytes per image;
- `ImageRef.data`, when set, is the same bytes base64-encoded (images under
  `media.inline_max_bytes`), and a reader prefers it to the store;
- the images of a prompt, in order, are its `image_ref` parts in message order
  (`prompt_images`); turn 0 and the scored trajectory carry that list.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = [
    "IMAGE_PLACEHOLDER",
    "ContentPart",
    "ImageRef",
    "ImageRefPart",
    "ImageUrl",
    "ImageUrlPart",
    "TextPart",
    "content_parts",
    "message_text",
    "prompt_images",
]

#: Where verl's datasets put each image of a row's `images` column in the text.
IMAGE_PLACEHOLDER = "<image>"


class TextPart(BaseModel):
    """A piece of a message's text."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = "text"
    text: str


class ImageUrl(BaseModel):
    """Where a user's image is: a `data:` URI, a file path or an http(s) URL."""

    model_config = ConfigDict(extra="allow")  # OpenAI's `detail` and the like, carried along

    url: str = Field(min_length=1, description="data: URI, file path or http(s) URL.")


class ImageUrlPart(BaseModel):
    """An image as the user gave it (replaced by an `ImageRefPart` at produce)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"] = "image_url"
    image_url: ImageUrl


class ImageRef(BaseModel):
    """An image by reference: its SHA-256 names it in the media store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the image's bytes.")
    mime_type: str = Field(pattern=r"^image/[a-z0-9.+-]+$", description="e.g. image/png.")
    size: int = Field(ge=1, description="Bytes of the encoded image.")
    data: str | None = Field(
        default=None, description="The bytes, base64, when under media.inline_max_bytes."
    )


class ImageRefPart(BaseModel):
    """An image of a message, by reference."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image_ref"] = "image_ref"
    image_ref: ImageRef


ContentPart = Annotated[TextPart | ImageUrlPart | ImageRefPart, Field(discriminator="type")]

_PARTS: TypeAdapter[list[ContentPart]] = TypeAdapter(list[ContentPart])


def content_parts(value: Any) -> str | list[ContentPart]:
    """A message's content validated: a string as it is, a list as parts. A wrong value
    raises `ValueError` saying what a content may be and which part is wrong, instead of
    pydantic's error for each member of the union."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"content must be a string or a list of parts, got {type(value).__name__}")
    try:
        return _PARTS.validate_python(value)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(
            f"part {where}: {first['msg']} (a part is {{'type': 'text', 'text': ...}} or "
            "{'type': 'image_url', 'image_url': {'url': data: URI | file path | http(s) URL}})"
        ) from None


def message_text(content: str | list[ContentPart], image: str = IMAGE_PLACEHOLDER) -> str:
    """The content as one string, each image written as `image`."""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else image for p in content)


def prompt_images(contents: Iterable[str | list[ContentPart]]) -> list[ImageRef]:
    """The image references of a prompt's messages' contents, in order."""
    return [
        part.image_ref
        for content in contents
        if not isinstance(content, str)
        for part in content
        if isinstance(part, ImageRefPart)
    ]
