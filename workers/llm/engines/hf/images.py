"""Image inputs of the `hf` engine (vision-language models, e.g. the `vl` preset's LLaVA).

A request's `images` are `ImageRef`s carrying their bytes inline (the client reads the media
store; a replica needs none). The prompt's token ids stay the contract: each image stands in
the prompt as `tokens_per_image` image-token ids, in order, exactly as the model's processor
expands its placeholder; `ImageInputs.prepare` checks that and turns the images into pixel
values with the model's image processor.

Prefix cache: the KV of an image's tokens depends on its pixels, not on its (identical)
placeholder ids, so a sequence's cache key is its prompt with each image's tokens replaced by
a negative id drawn from the image's SHA-256 (`Prepared.key`): a cached prefix is reused only
for the same images, and a reuse that would end inside an image is cut back to its start
(`Prepared.feed`), so the forward always gets whole images.

An image token the model *generated* is a plain token (`workers.llm.policy.plain_image_tokens`,
which the trainer's recomputation uses too).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from schemas.media import ImageRef
from workers.llm.engines.exceptions import InvalidRequestError
from workers.llm.engines.hf.prefix_cache import KV
from workers.media.exceptions import MediaError
from workers.media.store import decode_image

__all__ = ["ImageInputs", "Prepared", "image_key"]


def image_key(sha256: str) -> int:
    """The negative cache-key id of an image's tokens (never a real token id)."""
    return -1 - int(sha256[:15], 16)


@dataclass(frozen=True)
class Prepared:
    """One request's images: cache key, where each image starts, their pixel values."""

    key: list[int]
    starts: list[int]
    length: int  # tokens per image
    token_id: int
    pixels: torch.Tensor  # (images, channels, height, width)

    def feed(self, reuse: int, prefix: KV | None) -> tuple[int, KV | None, dict[str, Any]]:
        """The cached prefix actually reused (never ending inside an image), its KV, and the
        forward's image arguments: the pixel values of the images after it (none when every
        image is in the cached prefix)."""
        for start in self.starts:
            if start < reuse < start + self.length:
                reuse = start
                break
        if prefix is not None:
            prefix = [(k[:, :, :reuse], v[:, :, :reuse]) for k, v in prefix] if reuse else None
        later = [i for i, start in enumerate(self.starts) if start >= reuse]
        return reuse, prefix, ({"pixel_values": self.pixels[later]} if later else {})

    def plain(self, input_ids: torch.Tensor, reuse: int) -> torch.Tensor:
        """Which of `input_ids` (the prompt from `reuse` on, shape (1, n)) are generated image
        tokens (after the last image): plain tokens (`plain_image_tokens`)."""
        after = max(0, self.starts[-1] + self.length - reuse) if self.starts else 0
        plain = input_ids == self.token_id
        plain[:, :after] = False
        return plain


class ImageInputs:
    """The image processor and image token of a vision-language model directory."""

    def __init__(self, model_dir: str, config: Any) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.token_id = int(getattr(config, "image_token_index", None) or config.image_token_id)
        self.length = int(config.image_seq_length)

    def prepare(self, prompt: Sequence[int], images: Sequence[ImageRef]) -> Prepared:
        starts = self._starts(prompt, len(images))
        decoded = []
        key = list(prompt)
        for index, (ref, start) in enumerate(zip(images, starts, strict=True)):
            decoded.append(_decode(ref, index))
            key[start : start + self.length] = [image_key(ref.sha256)] * self.length
        pixels = self.processor(images=decoded, return_tensors="pt")["pixel_values"]
        return Prepared(
            key=key,
            starts=starts,
            length=self.length,
            token_id=self.token_id,
            pixels=pixels.float(),
        )

    def _starts(self, prompt: Sequence[int], images: int) -> list[int]:
        """Where each image's run of image tokens starts: the first `images` runs, each
        exactly `length` long; image tokens after the last run are generated, plain tokens."""
        starts: list[int] = []
        i = 0
        while i < len(prompt) and len(starts) < images:
            if prompt[i] != self.token_id:
                i += 1
                continue
            end = i
            while end < len(prompt) and prompt[end] == self.token_id:
                end += 1
            if end - i != self.length:
                break
            starts.append(i)
            i = end
        if len(starts) != images:
            count = sum(1 for t in prompt if t == self.token_id)
            raise InvalidRequestError(
                f"the prompt has {count} image tokens (id {self.token_id}) for {images} "
                f"images: each image is {self.length} consecutive image tokens"
            )
        return starts


def _decode(ref: ImageRef, index: int) -> Any:
    if ref.data is None:
        raise InvalidRequestError(f"images.{index}: carries no data (send the bytes inline)")
    try:
        data = base64.b64decode(ref.data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"images.{index}: data is not base64: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise InvalidRequestError(f"images.{index}: the bytes do not hash to its sha256")
    try:
        return decode_image(data)
    except MediaError as exc:
        raise InvalidRequestError(f"images.{index}: {exc}") from exc
