"""A vision-language replica on vLLM's CPU build: the `vl` preset (tiny LLaVA) served by
`rollout replica serve --backend vllm`, a contract request with an image (token ids with the
image's placeholder expanded, the image's bytes inline) answered through vLLM's token-in
`/inference/v1/generate` route.

The whole flow on vLLM too (`image_flow`, tests/integration/test_images.py's, on the real
broker): prompts → turns → scored → replay → a trainer step, the trainer's recomputed logprobs
equal to vLLM's within 1e-4.

Parity: for two images, the logprobs vLLM returns for its generated tokens equal the trainer's
recomputation (its policy loader and image processor, fp32) within 1e-4, and another image
gives other logprobs. This held only once the adapter sent one `<image>` per image: vLLM expands
a token-in prompt's placeholder itself, and an already-expanded run was expanded again (the gap
was up to 0.1; `vllm_mapping.collapse_image_placeholders`). After `/update_weights` to a
checkpoint the trainer wrote (`save_checkpoint`), vLLM serves exactly that checkpoint's policy.
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.test_images import image_flow
from tests.vllm.support import FAST_START, VLLM_CPU_ENV, VLLM_PYTHON, Replica

pytestmark = pytest.mark.vllm

TEXT = "<|im_start|>user\n<image>What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
TOKENS = 4


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


class _Trainer:
    """The trainer's recomputation: its policy loader and its image processor, fp32."""

    def __init__(self, model: Path) -> None:
        import torch
        from transformers import AutoImageProcessor

        from workers.trainer.images import load_policy

        self.net = load_policy(model, dtype=torch.float32).eval()
        self.pixels = AutoImageProcessor.from_pretrained(model)

    def logprobs(self, prompt: list[int], data: bytes, tokens: list[int]) -> list[float]:
        import torch

        from workers.media.store import decode_image

        pixels = self.pixels(images=[decode_image(data)], return_tensors="pt")["pixel_values"]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = self.net(input_ids=ids, pixel_values=pixels.float()).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        return [logp[i, t].item() for i, t in enumerate(tokens)]


def _trainer_checkpoint(model: Path, root: Path) -> Path:
    """The policy of `model` with every weight moved a little, written as the trainer writes a
    checkpoint (`save_checkpoint`): what `/update_weights` loads after a step."""
    import torch

    from workers.trainer.images import load_policy
    from workers.weights.checkpoint import TrainerState, save_checkpoint

    policy = load_policy(model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return save_checkpoint(root, TrainerState(version=1), policy, tokenizer_from=model)


def test_an_image_prompt_through_vllm_has_the_trainers_logprobs(tmp_path: Path) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    from pipeline.harness.models.tiny import init_model

    model = init_model(tmp_path / "vl", preset="vl", seed=0)
    processor = AutoProcessor.from_pretrained(model)
    images = {"red": _png((200, 0, 0)), "blue": _png((0, 0, 200))}
    # The contract's prompt: the placeholder expanded as the processor expands it.
    prompt = list(processor(text=TEXT, images=[Image.open(io.BytesIO(images["red"]))])[
        "input_ids"
    ][0])  # fmt: skip
    assert prompt.count(processor.tokenizer.convert_tokens_to_ids("<image>")) == 4
    answers = {}
    updated = _trainer_checkpoint(model, tmp_path / "ckpt")
    with Replica(model, free_port(), tmp_path / "replica.log", max_model_len=256) as replica:
        for name, data in images.items():
            body = replica.complete(
                prompt=prompt, max_tokens=TOKENS, temperature=1.0, seed=0, logprobs=0,
                images=[_ref(data)],
            )  # fmt: skip
            (choice,) = body["choices"]
            answers[name] = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
        # A weight update from a checkpoint the trainer wrote: vLLM serves exactly it.
        replica.update_weights(updated, 1)
        body = replica.complete(
            prompt=prompt, max_tokens=TOKENS, temperature=1.0, seed=0, logprobs=0,
            images=[_ref(images["red"])],
        )  # fmt: skip
        (choice,) = body["choices"]
        after = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
        assert body["policy_version"] == 1, body
    new = _Trainer(updated).logprobs(prompt, images["red"], after[0])
    gap = max(abs(a - b) for a, b in zip(new, after[1], strict=True))
    print(f"after the update: vLLM vs the trainer's checkpoint max |diff| {gap:.2e}")
    assert gap < 1e-4, (after, new)
    trainer = _Trainer(model)
    stale = trainer.logprobs(prompt, images["red"], after[0])
    assert max(abs(a - b) for a, b in zip(stale, after[1], strict=True)) > 1e-3  # it moved
    for name, (tokens, logprobs) in answers.items():
        assert len(tokens) == TOKENS and len(logprobs) == TOKENS, answers
        want = trainer.logprobs(prompt, images[name], tokens)
        gap = max(abs(a - b) for a, b in zip(want, logprobs, strict=True))
        print(f"{name}: vLLM vs trainer max |diff| {gap:.2e}: {logprobs} {want}")
        assert gap < 1e-4, (name, logprobs, want)
    # The same tokens under the other image: other logprobs (the image reached the model).
    tokens, logprobs = answers["red"]
    other = trainer.logprobs(prompt, images["blue"], tokens)
    apart = max(abs(a - b) for a, b in zip(other, logprobs, strict=True))
    print(f"red's tokens under the blue image: logprobs differ by up to {apart:.3g}")
    assert apart > 1e-3, (logprobs, other)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(900)  # vLLM's start: one to several minutes on a busy CPU
def test_image_prompts_flow_through_vllm_to_a_trainer_step(
    kafka_config, kafka_bootstrap, topics_config, tmp_path: Path
) -> None:
    from pipeline.harness.models.tiny import init_model

    model = init_model(tmp_path / "vl", preset="vl", seed=0)
    replica_args = (
        "--vllm-python", str(VLLM_PYTHON), "--dtype", "float32", "--max-model-len", "256",
        *FAST_START,
    )  # fmt: skip
    image_flow(
        kafka_config, kafka_bootstrap, topics_config, model, tmp_path,
        backend="vllm", replica_args=replica_args, extra_env=VLLM_CPU_ENV, timeout_s=600.0,
    )  # fmt: skip
