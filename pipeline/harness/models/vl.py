"""The `vl` preset: a tiny LLaVA (CLIP vision tower → projector → the `tiny` Qwen2), built like
`model_init`'s models so nothing is downloaded.

Why LLaVA: its image tokens are one placeholder expanded to a fixed count and its positions
are 1-D, so the hf engine's prefill/decode and prefix cache work unchanged around the image
features; transformers (`AutoModelForImageTextToText`) and vLLM both serve it.

Invariants:
- the tokenizer is the project's (`build_tokenizer`) plus one added special token `<image>`
  (id 1024, after every id of the text models, so text token ids mean the same); the
  processor (`AutoProcessor`: `LlavaProcessor`, CLIP image processor at 28×28 pixels, patch
  14) expands each `<image>` to `IMAGE_TOKENS` (4) copies, as vLLM does (vLLM expands a
  token-in prompt's `<image>` itself, so its adapter sends one per image:
  `vllm_mapping.collapse_image_placeholders`; both engines then compute the same logprobs,
  within 1e-6 in fp32, tests/vllm/test_images.py);
- the weights are a pure function of `seed`; the global torch RNG is left as it was;
- the vision tower's weights are saved as `vision_tower.vision_model.*` (CLIPVisionModel's
  own layout, which vLLM 0.32 loads); transformers 5 saves them as `vision_tower.*`, which
  vLLM refuses ("no module or parameter named 'vision_tower.embeddings'"), and loads both.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["IMAGE_SIZE", "IMAGE_TOKEN", "IMAGE_TOKENS", "init_vl_model"]

logger = logging.getLogger("rollout.llm.model_init")

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
"""Tokens each image becomes: one per patch (the CLS feature is dropped, `default`)."""


def init_vl_model(out: Path, text_config: dict[str, Any], tokenizer: Any, seed: int) -> Path:
    """Write the tiny LLaVA, its tokenizer (with `<image>`) and processor into `out`."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = Qwen2Config(**{**text_config, "vocab_size": len(tokenizer)})
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=IMAGE_TOKENS,
        tie_word_embeddings=True,
    )
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        bos_token_id=None,
        do_sample=True,
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        ),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    model.save_pretrained(out, safe_serialization=True)
    _vision_model_layout(out)
    processor.save_pretrained(out)
    logger.info(
        "wrote vl model seed=%d vocab=%d params=%d to %s",
        seed,
        len(tokenizer),
        sum(p.numel() for p in model.parameters()),
        out,
    )
    return out


def _vision_model_layout(out: Path) -> None:
    """Rename the saved `vision_tower.X` weights to `vision_tower.vision_model.X` (module doc)."""
    from safetensors.torch import load_file, save_file

    prefix, layout = "vision_tower.", "vision_tower.vision_model."
    for path in sorted(out.glob("*.safetensors")):
        weights = load_file(path)
        renamed = {
            layout + k[len(prefix) :] if k.startswith(prefix) and not k.startswith(layout) else k: v
            for k, v in weights.items()
        }
        save_file(renamed, path, metadata={"format": "pt"})
