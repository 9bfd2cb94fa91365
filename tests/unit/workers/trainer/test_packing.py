"""Packed forwards against the padded reference (issue 42), CPU, fp32.

Ragged multi-turn batches (tool tokens masked): the packed layout gives the padded layout's
logprobs within 1e-5, and the same loss and gradients within 1e-5 relative for every
`loss_agg_mode`, whatever the micro-batches (by count, or by a token budget); the `moe` preset
under `router_replay=r3` and the `vl` preset too. Chunked logprobs/entropy equal the full
computation within 1e-6. The sharded trainer's case (2 gloo ranks) is
`tests/integration/test_trainer_packed_sharded.py`.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from schemas.events import ExtraFields, ScoredTrajectory
from workers.trainer.batching import TrajectoryBatch, collate
from workers.trainer.config import TrainerConfig
from workers.trainer.logprobs import head_log_probs, response_log_probs
from workers.trainer.step import UpdateCounts, micro_batches_of, micro_loss, train_step

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PADDED = {"packed": False, "logprob_chunk_tokens": None}


def _model(vocab: int = 512, seed: int = 0) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).to(torch.float32).train()


def ragged_batch(groups: int = 3, n: int = 3, seed: int = 0, vocab: int = 512) -> TrajectoryBatch:
    """Groups of multi-turn samples: prompts of 3-24 tokens, responses of 1-40 with tool spans
    (response_mask 0) in the middle, behaviour logprobs near a random policy's, and reference
    logprobs for the KL term."""
    rng = random.Random(seed)
    samples, advantages = [], []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 24))]
        for i in range(n):
            length = rng.randint(1, 40)
            mask = [1] * length
            for _ in range(rng.randint(0, 2)):  # tool turns: their tokens are not trained
                at = rng.randrange(length)
                mask[at : at + rng.randint(1, 6)] = [0] * len(mask[at : at + 6])
            samples.append(
                ScoredTrajectory(
                    uid=f"g{g}",
                    trajectory_id=f"g{g}/{i}",
                    sample_index=i,
                    attempt_id="a",
                    data_source="t",
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(3, vocab) for _ in range(length)],
                    response_mask=mask[:length],
                    response_logprobs=[-rng.uniform(5.5, 7.0) for _ in range(length)],
                    num_turns=3,
                    reward_score=float(i % 2),
                    extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
                )
            )
            advantages.append(rng.uniform(-1.5, 1.5))
    batch = collate(samples, advantages)
    batch.tensors["ref_logprobs"] = batch["old_logprobs"] + 0.3 * batch["response_mask"]
    return batch


def _grads(model: Any, batch: TrajectoryBatch, config: TrainerConfig) -> tuple[float, Any]:
    """The loss of one update on `batch` and its gradient, micro-batch by micro-batch."""
    model.zero_grad(set_to_none=True)
    counts = UpdateCounts.of(batch, config)
    total = 0.0
    for micro in micro_batches_of(batch, config):
        out = micro_loss(model, micro, config, counts)
        out.loss.backward()
        total += float(out.loss.detach())
    return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _real(batch: TrajectoryBatch) -> torch.Tensor:
    return batch["attention_mask"][:, batch.prompt_length :].bool()


def test_packed_logprobs_equal_the_padded_ones() -> None:
    model, batch = _model(), ragged_batch()
    with torch.no_grad():
        padded, h_padded = response_log_probs(model, batch, packed=False, chunk_tokens=None)
        packed, h_packed = response_log_probs(model, batch, chunk_tokens=16)
    real = _real(batch)
    diff = float((packed - padded)[real].abs().max())
    print(
        {
            "max_logprob_diff": diff,
            "max_entropy_diff": float((h_packed - h_padded)[real].abs().max()),
        }
    )
    assert diff < 1e-5
    assert float((h_packed - h_padded)[real].abs().max()) < 1e-5
    assert float(packed[~real].abs().max()) == 0.0  # nothing computed on padding


@pytest.mark.parametrize("mode", AGG_MODES)
def test_packed_loss_and_gradients_equal_the_padded_ones_whatever_the_split(mode: str) -> None:
    """One update: the padded reference in micro-batches of 2 samples vs packed micro-batches of
    4 samples and vs packed micro-batches by a 48-token budget (other splits, other order)."""
    model, batch = _model(), ragged_batch()
    common = {"loss_agg_mode": mode, "kl_coef": 0.1, "entropy_coeff": 0.01}
    ref_loss, ref_grad = _grads(model, batch, TrainerConfig(micro_batch_size=2, **common, **PADDED))
    for split in ({"micro_batch_size": 4}, {"max_tokens_per_micro_batch": 48}):
        config = TrainerConfig(**split, logprob_chunk_tokens=8, **common)
        assert len(micro_batches_of(batch, config)) > 1
        loss, grad = _grads(model, batch, config)
        print(
            {"mode": mode, **split, "loss": (loss, ref_loss), "grad_rel": _relative(grad, ref_grad)}
        )
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert _relative(grad, ref_grad) < 1e-5


def test_a_packed_step_of_several_updates_equals_the_padded_step() -> None:
    """ppo_mini_batches 2, ppo_epochs 2 (proximal logprobs up front, the clip acting), KL to
    a reference model: the weights after the step agree."""
    base, batch = _model(), ragged_batch(groups=4)
    ref_model = _model(seed=1).eval()
    weights = []
    for extra in (PADDED | {"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 64}):
        model = copy.deepcopy(base)
        config = TrainerConfig(ppo_mini_batches=2, ppo_epochs=2, kl_coef=0.1, lr=1e-3, **extra)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        metrics = train_step(model, optimizer, batch, config, ref_model=ref_model)
        assert metrics["pg_clipfrac"] > 0 and metrics["skipped_nonfinite"] == 0
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in base.parameters()])
    moved = float((weights[0] - start).abs().max())
    diff = float((weights[1] - weights[0]).abs().max())
    print({"max_abs_param_diff": diff, "max_abs_update": moved})
    assert diff < 1e-5 < moved


def test_moe_with_r3_packed_equals_padded() -> None:
    """The `moe` geometry (Qwen3-MoE) under router_replay=r3: the recorded experts are packed
    like the tokens, so logprobs, loss and gradients are the padded layout's."""
    from tests.unit.workers.trainer.moe_helpers import (
        make_batch,
        moe_model,
        perturbed,
        routed,
        sequences,
    )

    a = moe_model(0)
    model = perturbed(a).train()
    pairs = sequences()
    batch = make_batch(pairs, [routed(a, p + r) for p, r in pairs])
    common = {"router_replay": "r3", "micro_batch_size": 2}
    ref_loss, ref_grad = _grads(model, batch, TrainerConfig(**common, **PADDED))
    loss, grad = _grads(model, batch, TrainerConfig(**common, logprob_chunk_tokens=4))
    print({"loss": (loss, ref_loss), "grad_rel": _relative(grad, ref_grad)})
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _relative(grad, ref_grad) < 1e-5
    one = train_step(
        copy.deepcopy(model),
        torch.optim.SGD(model.parameters(), lr=0.0),
        batch,
        TrainerConfig(**common),
    )
    assert one["router_mismatch_rate"] == 0 and one["router_rows"] > 0


def test_the_vl_preset_packed_equals_padded(vl_model: Any, tmp_path: Any) -> None:
    """Two image groups (each image's tokens in its prompt) and the pixels in sample order:
    the packed forward places each image where the padded one does."""
    from transformers import AutoProcessor

    from tests.integration.trainer_helpers import image_group, png
    from workers.media.config import MediaConfig
    from workers.media.store import MediaStore
    from workers.trainer.batching import collate_groups
    from workers.trainer.images import BatchImages, load_policy

    store = MediaStore(tmp_path / "store")
    policy = load_policy(vl_model, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(vl_model)
    groups = []
    for uid, color in (("red", (220, 0, 0)), ("blue", (0, 0, 220))):
        data = png(color)
        groups.append(
            image_group(policy.eval(), processor, uid, store.put(data, "image/png"), data)
        )
    batch = collate_groups(groups)
    batch = BatchImages(MediaConfig(store_dir=str(tmp_path / "store")), vl_model).attach(batch)
    policy.train()
    with torch.no_grad():
        padded, _ = response_log_probs(policy, batch, packed=False, chunk_tokens=None)
        packed, _ = response_log_probs(policy, batch)
    real = _real(batch)
    rollout = batch["old_logprobs"]
    print({"max_logprob_diff": float((packed - padded)[real].abs().max())})
    assert float((packed - padded)[real].abs().max()) < 1e-5
    assert float((packed - rollout)[real].abs().max()) < 1e-4  # the rollout's own logprobs
    ref_loss, ref_grad = _grads(policy, batch, TrainerConfig(micro_batch_size=4, **PADDED))
    loss, grad = _grads(policy, batch, TrainerConfig(micro_batch_size=3))
    vision = [p.grad for n, p in policy.named_parameters() if "vision" in n and p.grad is not None]
    print({"loss": (loss, ref_loss), "grad_rel": _relative(grad, ref_grad)})
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _relative(grad, ref_grad) < 1e-5
    assert vision and any(float(g.abs().max()) > 0 for g in vision)  # the pixels counted


def test_chunked_logprobs_and_entropy_equal_the_full_computation() -> None:
    """`head_log_probs` in chunks of 7 rows (checkpointed) vs all at once: values and the
    gradients of hidden states and head, within 1e-6."""
    generator = torch.Generator().manual_seed(0)
    # A trained model's scale: logits of std ~1 over 1,000 tokens, logprobs near -7.
    hidden = torch.randn(50, 32, generator=generator).mul(0.2).requires_grad_()
    weight = torch.randn(1000, 32, generator=generator).requires_grad_()
    targets = torch.randint(0, 1000, (50,), generator=generator)
    grads = []
    for chunk in (None, 7):
        hidden.grad = weight.grad = None
        logp, entropy = head_log_probs(
            hidden, weight, targets, chunk_tokens=chunk, entropy_grad=True
        )
        (logp * torch.linspace(-1, 1, 50)).sum().add(0.1 * entropy.sum()).backward()
        grads.append((logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()))
    full, chunked = grads
    diffs = [float((a - b).abs().max()) for a, b in zip(full, chunked, strict=True)]
    scale = [float(a.abs().max()) for a in full]
    print({"logp": diffs[0], "entropy": diffs[1], "d_hidden": diffs[2], "d_head": diffs[3]})
    assert max(diffs[:2]) < 1e-6  # the values
    assert all(d < 1e-6 * s for d, s in zip(diffs[2:], scale[2:], strict=True))  # gradients
