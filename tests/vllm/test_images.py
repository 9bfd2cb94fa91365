"""A vision-language replica on vLLM's CPU build: the `vl` preset (tiny LLaVA) served by
`rollout replica serve --backend vllm`, a contract request with an image (token ids with the
image's placeholder expanded, the image's bytes inline) answered through vLLM's token-in
`/inference/v1/generate` route: tokens with their logprobs, and other logprobs for another image
(the image reached the model, not only its placeholder tokens).

Not held yet, so not asserted: parity with the trainer. vLLM's logprobs for this model differ
from a transformers fp32 forward of the same image by up to 0.10 (vLLM's offline engine too:
-5.891 vs -5.963 for the red image's first token), where text-only models match within 1e-3
(test_weight_sync.py). The gap is printed here; README "Images" has it.
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.vllm.support import Replica

pytestmark = pytest.mark.vllm

TEXT = "<|im_start|>user\n<image>What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"


def _png(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (28, 28), color).save(out, format="PNG")
    return out.getvalue()


def _ref(data: bytes) -> dict:
    return {
        "sha256": hashlib.sha256(data).hexdigest(),
        "mime_type": "image/png",
        "size": len(data),
        "data": base64.b64encode(data).decode(),
    }


def _reference(model: Path, data: bytes, tokens: list[int]) -> list[float]:
    """Log-probabilities of `tokens` after the prompt, by a transformers fp32 forward."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    net = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    enc = processor(text=TEXT, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    ids = torch.cat([enc["input_ids"], torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        logits = net(input_ids=ids, pixel_values=enc["pixel_values"]).logits[0].float()
    start = enc["input_ids"].shape[1] - 1
    logp = torch.log_softmax(logits[start : start + len(tokens)], dim=-1)
    return [logp[i, t].item() for i, t in enumerate(tokens)]


def test_an_image_prompt_is_served_through_the_contract_and_its_image_counts(
    tmp_path: Path,
) -> None:
    from transformers import AutoProcessor

    from workers.llm.model_init import init_model

    model = init_model(tmp_path / "vl", preset="vl", seed=0)
    processor = AutoProcessor.from_pretrained(model)
    red, blue = _png((200, 0, 0)), _png((0, 0, 200))
    from PIL import Image

    prompt = processor(text=TEXT, images=[Image.open(io.BytesIO(red))])["input_ids"][0]
    answers = {}
    with Replica(model, free_port(), tmp_path / "replica.log", max_model_len=256) as replica:
        for name, data in (("red", red), ("blue", blue)):
            body = replica.complete(
                prompt=list(prompt), max_tokens=4, temperature=1.0, seed=0, logprobs=0,
                images=[_ref(data)],
            )  # fmt: skip
            (choice,) = body["choices"]
            answers[name] = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
    tokens, logprobs = answers["red"]
    assert len(tokens) == 4 and len(logprobs) == 4, answers
    assert all(lp < 0 for lp in logprobs), answers
    # Same prompt tokens, same seed: only the image differs, and so does what vLLM answers.
    assert answers["red"] != answers["blue"], answers
    want = _reference(model, red, tokens)
    gap = max(abs(a - b) for a, b in zip(want, logprobs, strict=True))
    print(f"vLLM vs transformers fp32, red image: max |diff| {gap:.4f}: {logprobs} {want}")
