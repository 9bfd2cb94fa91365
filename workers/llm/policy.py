"""What the engines and the trainer share of a policy model: loading it, its image tokens.

The `hf` engine serves a policy and the trainer trains the same one (and lends it, as an `hf`
engine, when idle): both load it with `load_model` (a vision-language model through
`AutoModelForImageTextToText`, any other through `AutoModelForCausalLM`), and both feed an
image token the model *generated* as a plain token (`plain_image_tokens`). A random policy
samples any id; a resumed or next-turn prompt then carries it after the images, and the
model's placeholder matching would count it as an image's (transformers: "Image features and
image tokens do not match"): it is embedded as its id, as it was when it was decoded, so the
trainer's recomputed logprobs are the engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["image_token_id", "load_model", "plain_image_tokens"]


def load_model(path: str | Path, **kwargs: Any) -> Any:
    """The model of `path`: `AutoModelForImageTextToText` for a vision-language config (one
    with a `vision_config`), else `AutoModelForCausalLM` (the engine's and the trainer's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(str(path)), "vision_config")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(str(path), **kwargs)


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
