"""An image token the policy generated is a plain token to the `hf` engine and the trainer.

A random vision-language policy samples any id, the image placeholder's too (1 in 1025 per
token for the `vl` preset; CI once met it). The sequence that carries it after the prompt's
images must still be served (a resumed or next-turn prompt) and trained: the placeholder
matching of the model would count it as an image's ("Image features and image tokens do not
match"). The reference is the engine's own way: a prefill of the prompt with its pixels, then
each token fed alone, by its id.
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipeline.harness.models.tiny import init_model  # noqa: E402
from schemas.events import ExtraFields, ScoredTrajectory  # noqa: E402
from schemas.media import ImageRef  # noqa: E402
from workers.llm.contract import SamplingParams  # noqa: E402
from workers.llm.engines.hf.engine import HFEngine, HFEngineConfig  # noqa: E402
from workers.llm.engines.hf.kv_batch import cache_kwarg  # noqa: E402
from workers.trainer.batching import collate  # noqa: E402
from workers.trainer.images import load_policy  # noqa: E402
from workers.trainer.step import response_log_probs  # noqa: E402

TEXT = "<|im_start|>user\n<image>What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (28, 28), (0, 90, 200)).save(out, format="PNG")
    return out.getvalue()


def _decoded_logprobs(model, enc, response: list[int]) -> list[float]:
    """log π of each `response` token: the prompt prefilled with its pixels, then token by token."""
    from transformers import DynamicCache

    cache = {cache_kwarg(model): DynamicCache()}  # filled in place
    with torch.no_grad():
        logits, logprobs = model(**enc, **cache).logits[0, -1], []
        for token in response:
            logprobs.append(torch.log_softmax(logits.float(), -1)[token].item())
            logits = model(input_ids=torch.tensor([[token]]), **cache).logits[0, -1]
    return logprobs


async def test_a_generated_image_token_is_served_and_trained_as_a_plain_token(
    tmp_path: Path,
) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    vl = init_model(tmp_path / "vl", preset="vl", seed=0)
    processor = AutoProcessor.from_pretrained(vl)
    data = _png()
    enc = processor(text=TEXT, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    prompt = enc["input_ids"][0].tolist()
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    generated = [17, image_token, 18]  # what was generated before an abort
    ref = ImageRef(
        sha256=hashlib.sha256(data).hexdigest(),
        mime_type="image/png",
        size=len(data),
        data=base64.b64encode(data).decode(),
    )

    engine = HFEngine(vl, HFEngineConfig(threads=1))
    try:  # the resume: what was generated is part of the prompt now
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
        resumed = await engine.generate(prompt + generated, params, "resume", images=[ref])
    finally:
        engine.close()
    response = generated + resumed.token_ids
    model = load_policy(vl, dtype=torch.float32).eval()
    expected = _decoded_logprobs(model, enc, response)
    engine_gap = max(abs(a - b) for a, b in zip(resumed.logprobs, expected[3:], strict=True))
    assert engine_gap < 1e-4, engine_gap

    sample = ScoredTrajectory(
        uid="u",
        trajectory_id="u/0",
        sample_index=0,
        attempt_id="u-att-0",
        data_source="test",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=[1] * len(response),
        response_logprobs=expected,
        num_turns=1,
        reward_score=1.0,
        extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
        images=[ref],
    )
    batch = collate([sample])
    batch.pixels = [enc["pixel_values"]]
    with torch.no_grad():
        recomputed, _ = response_log_probs(model, batch)
    gap = (recomputed[0, : len(response)] - torch.tensor(expected)).abs().max().item()
    assert gap < 1e-4, gap
