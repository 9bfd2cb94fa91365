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

An image token the model *generated* (a random policy samples any id; a resumed or next-turn
prompt then carries it after the images) is a plain token, embedded as its id, as it was when
it was decoded: `plain_image_tokens` keeps it out of the model's placeholder matching, which
would count it as an image's (transformers: "Image features and image tokens do not match").
The trainer recomputes its logprobs the same way (`workers.trainer.step`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.media import ImageRef
from workers.llm.replicas.exceptions import InvalidRequestError
from workers.llm.replicas.prefix_cache import KV
from workers.media.exceptions import MediaError
from workers.media.store import decode_image

__all__ = [
    "ImageInputs",
    "Prepared",
    "image_key",
    "image_token_id",
    "load_model",
    "plain_image_tokens",
]


def load_model(path: str | Path, **kwargs: Any) -> Any:
    """The model of `path`: `AutoModelForImageTextToText` for a vision-language config (one
    with a `vision_config`), else `AutoModelForCausalLM` (the engine's and the trainer's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(str(path)), "vision_config")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(str(path), **kwargs)


def image_key(sha256: str) -> int:
    """The negative cache-key id of an image's tokens (never a real token id)."""
    return -1 - int(sha256[:15], 16)


def image_token_id(config: Any) -> int | None:
    """The image placeholder's token id of a model config (None for a text model)."""
    for key in ("image_token_index", "image_token_id"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    return None


@contextmanager
def plain_image_tokens(model: Any, input_ids: torch.Tensor, plain: torch.Tensor) -> Iterator[Any]:
    """The `input_ids` to feed `model` while the image tokens at `plain` (a bool mask of its
    shape) read as plain tokens (module docstring): they are fed as another id, which the
    placeholder matching skips, and the input embedding puts the image token's own row back
    (its gradient reaches that row, as a plain token's would)."""
    token_id = image_token_id(model.config)
    if token_id is None or not bool(plain.any()):
        yield input_ids
        return
    at = plain.unsqueeze(-1)

    def embed_as_image_token(module: Any, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.where(at, module.weight[token_id].to(output.dtype), output)

    handle = model.get_input_embeddings().register_forward_hook(embed_as_image_token)
    try:
        yield input_ids.masked_fill(plain, 0 if token_id else 1)
    finally:
        handle.remove()


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
