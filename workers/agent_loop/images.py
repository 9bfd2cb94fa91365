"""A prompt's images, made ready for its agent loops (or refused with a dead-letter reason).

Before any sample of a prompt runs, `PromptImages.resolve`:
1. stores any `image_url` part still in the prompt (a prompt produced without `rollout
   produce`) as `workers.media.ingest` does, so every event after it carries references;
2. reads each referenced image (inline bytes, else the media store) and decodes it;
3. refuses images for a text-only policy: training on the text alone would change the task.

A failure is an `AgentLoopError` whose `cause` the dead letter carries: `image_missing` (the
store has no such file), `image_corrupt`, `image_unreadable`, `image_too_large`,
`image_unsupported` (a text-only policy, or an agent loop that does not take images). Only
the prompt is lost; the worker goes on with the others.

For a vision-language policy the loop gets `LoopImages`: the messages' text with the model's
image token where each image was (`messages`), `expand` to turn each image token of the
tokenized prompt into the tokens the model's processor makes of that image (the prompt ids
are the contract, as in vLLM), and `refs`, the references with their bytes inline, for the
replica.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.events import PromptEvent
from schemas.media import ImageRef, message_text, prompt_images
from workers.agent_loop.exceptions import AgentLoopError
from workers.media.config import MediaConfig
from workers.media.exceptions import MediaError
from workers.media.ingest import Ingestor
from workers.media.store import decode_image

__all__ = ["LoopImages", "PromptImages", "is_vision_model", "messages_of"]

#: Files a transformers processor with an image processor is saved as.
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def is_vision_model(model: str, tokenizer: Any = None) -> bool:
    """Whether the policy takes images: its directory holds an image processor's config, or
    (a hub name) its tokenizer names an image token."""
    directory = Path(model).expanduser() if model else None
    if directory is not None and directory.is_dir():
        return any((directory / name).is_file() for name in _PROCESSOR_FILES)
    return getattr(tokenizer, "image_token", None) is not None


def messages_of(prompt: PromptEvent, image_token: str = "<image>") -> list[dict[str, Any]]:
    """The prompt's messages for a chat template: each content one string, an image written
    as `image_token`."""
    out = []
    for message in prompt.prompt:
        data = message.model_dump(exclude_none=True)
        data["content"] = message_text(message.content, image=image_token)
        out.append(data)
    return out


@dataclass(frozen=True)
class LoopImages:
    """A prompt's images as an agent loop uses them (module docstring)."""

    refs: list[ImageRef]  # bytes inline, for the replica
    token_id: int
    counts: list[int]  # tokens the processor makes of each image

    def expand(self, prompt_ids: list[int]) -> list[int]:
        """`prompt_ids` with the i-th image token repeated as the processor expands image i."""
        if prompt_ids.count(self.token_id) != len(self.counts):
            raise AgentLoopError(
                f"the rendered prompt has {prompt_ids.count(self.token_id)} image tokens for "
                f"{len(self.counts)} images",
                cause="image_unsupported",
            )
        out: list[int] = []
        counts = iter(self.counts)
        for token in prompt_ids:
            out.extend([token] * next(counts) if token == self.token_id else [token])
        return out


class PromptImages:
    """Resolve the images of prompts against the run's media store."""

    def __init__(
        self, config: MediaConfig, *, vision: bool, model: str = "", processor: Any = None
    ) -> None:
        self.ingest = Ingestor(config)
        self.vision = vision
        self.model = model or "the policy"
        self.processor = processor  # the VL policy's transformers processor
        self.token = str(getattr(processor, "image_token", None) or "<image>")

    def resolve(self, prompt: PromptEvent) -> tuple[PromptEvent, LoopImages | None]:
        """The prompt with references only, and its images for the loop (None: no image);
        `AgentLoopError` with the dead-letter cause when one fails."""
        try:
            prompt = self.ingest(prompt)
            refs = prompt_images(m.content for m in prompt.prompt)
            blobs = [self.ingest.store.get(ref) for ref in refs]
            images = [decode_image(blob) for blob in blobs]
        except MediaError as exc:
            raise AgentLoopError(str(exc), cause=exc.cause) from exc
        if not images:
            return prompt, None
        if not self.vision or self.processor is None:
            raise AgentLoopError(
                f"the prompt has {len(images)} image(s) but {self.model} is a text-only model "
                "(no image processor beside it): refused, not trained on the text alone",
                cause="image_unsupported",
            )
        token_id = self.processor.tokenizer.convert_tokens_to_ids(self.token)
        counts = [
            self.processor(text=self.token, images=[image])["input_ids"][0].count(token_id)
            for image in images
        ]
        inline = [
            ref.model_copy(update={"data": base64.b64encode(blob).decode()})
            for ref, blob in zip(refs, blobs, strict=True)
        ]
        return prompt, LoopImages(refs=inline, token_id=token_id, counts=counts)
