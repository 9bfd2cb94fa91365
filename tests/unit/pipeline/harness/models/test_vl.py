"""`rollout model init --preset vl`: a tiny LLaVA that transformers loads with its processor."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from pipeline.harness.models.tiny import init_model
from pipeline.harness.models.vl import IMAGE_TOKEN, IMAGE_TOKENS


def test_the_vl_preset_loads_and_its_image_changes_the_logits(tmp_path: Path) -> None:
    out = init_model(tmp_path / "vl", preset="vl", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == 1024  # after every text token id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2  # text ids as in `tiny`
    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    logits = []
    for color in ((255, 0, 0), (0, 0, 255)):
        enc = processor(
            text=f"{IMAGE_TOKEN}What?",
            images=[Image.new("RGB", (40, 30), color)],
            return_tensors="pt",
        )
        assert enc["input_ids"][0].tolist().count(1024) == IMAGE_TOKENS
        with torch.no_grad():
            logits.append(model(**enc).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-4
