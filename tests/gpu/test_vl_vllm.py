"""The `vl` preset (tiny LLaVA) in vLLM, offline engine, token ids in (issue 32).

Run by infra/gpu_check.sh (`VL_CHECK`, marker `gpu`) where vLLM has torchvision: vLLM 0.32's
CPU build here cannot inspect `LlavaForConditionalGeneration` without it (README "Images"), so
this has not run yet. The prompt's token ids hold the image's placeholder expanded as the
model's processor expands it (the contract); two images must give different logprobs, and the
same image the logprobs a transformers forward (fp32, CPU) gives, within `TOLERANCE`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-2  # fp32 on a GPU's kernels against the CPU; the figure is in the message


def _image(color: tuple[int, int, int]):
    from PIL import Image

    return Image.new("RGB", (28, 28), color)


def test_the_vl_preset_generates_from_token_ids_and_an_image() -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import LLM, SamplingParams

    from pipeline.harness.models.tiny import init_model

    model = Path(os.environ.get("ROLLOUT_VL_MODEL", "/tmp/rollout_vl_model"))
    if not (model / "config.json").is_file():
        init_model(model, preset="vl", seed=0)
    processor = AutoProcessor.from_pretrained(model)
    text = "<|im_start|>user\n<image>What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    ids = processor(text=text, images=[_image((200, 0, 0))])["input_ids"][0]
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, enforce_eager=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    first = []
    for color in ((200, 0, 0), (0, 0, 200)):
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": _image(color)}}
        out = llm.generate(prompt, params)[0].outputs[0]
        first.append((out.token_ids[0], next(iter(out.logprobs[0].values())).logprob))
    assert first[0][1] != first[1][1], first
    reference = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    enc = processor(text=text, images=[_image((200, 0, 0))], return_tensors="pt")
    with torch.no_grad():
        logits = reference(**enc).logits[0, -1]
    want = torch.log_softmax(logits, -1)[first[0][0]].item()
    assert abs(want - first[0][1]) < TOLERANCE, (want, first[0][1])
