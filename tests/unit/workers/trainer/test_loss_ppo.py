"""The trust region and the regularisers: mini-batches, KL estimators, aggregation, dual clip."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.events import ExtraFields, ScoredTrajectory
from workers.trainer.batching import collate
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import agg_loss, kl_penalty, policy_loss


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize(
    ("name", "formula"),
    [
        ("k1", lambda x: x),
        ("kl", lambda x: x),
        ("k2", lambda x: 0.5 * x * x),
        ("mse", lambda x: 0.5 * x * x),
        ("k3", lambda x: math.exp(-x) - 1 + x),
        ("low_var_kl", lambda x: math.exp(-x) - 1 + x),
    ],
)
def test_each_kl_estimator_against_its_formula(name: str, formula) -> None:
    logp = _t([[-1.0, -2.0, -0.5, -3.0]])
    ref = _t([[-1.5, -1.0, -0.5, -2.0]])
    got = kl_penalty(logp, ref, name).tolist()[0]
    want = [formula(a - b) for a, b in zip(logp[0].tolist(), ref[0].tolist(), strict=True)]
    assert got == pytest.approx(want, abs=1e-6)


def test_the_k3_estimate_is_bounded() -> None:
    assert kl_penalty(_t([[-50.0]]), _t([[0.0]]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(_t([[0.0]]), _t([[0.0]]), "k4")  # type: ignore[arg-type]


def test_loss_aggregation_modes_by_hand() -> None:
    values = _t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = _t([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(values, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(values, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(values, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert agg_loss(values, mask, "seq-mean-token-sum-norm", norm_length=5).item() == (
        pytest.approx(10 / (2 * 5))
    )
    # Micro-batches given the whole update's counts add up to the whole.
    halves = [
        agg_loss(
            values[i : i + 1], mask[i : i + 1], mode, token_count=4, seq_count=2, norm_length=3
        ).item()
        for mode in ("token-mean", "seq-mean-token-mean")
        for i in (0, 1)
    ]
    assert halves[0] + halves[1] == pytest.approx(10 / 4)
    assert halves[2] + halves[3] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(values, mask, "sum")  # type: ignore[arg-type]


def test_dual_clip_bounds_a_negative_advantage_with_a_huge_ratio() -> None:
    old = _t([[0.0, 0.0]])
    logp = torch.log(_t([[5.0, 5.0]]))  # ratio 5
    adv = _t([[-1.0, 1.0]])
    mask = _t([[1, 1]])
    kw = {"rollout_is_threshold": 1e6}
    plain = policy_loss(logp, old, old, adv, mask, **kw)
    dual = policy_loss(logp, old, old, adv, mask, clip_ratio_c=3.0, **kw)
    # token 0: max(5, 0.8) = 5 → dual clip min(5, 3) = 3; token 1: max(−5, −1.2) = −1.2.
    assert plain.loss.item() == pytest.approx((5 - 1.2) / 2)
    assert dual.loss.item() == pytest.approx((3 - 1.2) / 2)
    assert dual.metrics["pg_clipfrac_lower_sum"] == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, old, adv, mask, clip_ratio_c=1.0)


def test_the_kl_term_pulls_toward_the_reference() -> None:
    logp = torch.tensor([[-0.2, -0.3]], requires_grad=True)
    ref = _t([[-1.0, -1.0]])
    zero = torch.zeros((1, 2))
    out = policy_loss(
        logp,
        logp.detach(),
        logp.detach(),
        zero,
        torch.ones((1, 2)),
        ref_log_prob=ref,
        kl_coef=0.5,
        kl_loss_type="k1",
    )
    out.loss.backward()
    assert out.metrics["kl_ref_sum"] == pytest.approx(0.8 + 0.7)
    assert logp.grad is not None and bool((logp.grad > 0).all())  # descent lowers log π_θ


def _samples(k: int = 4, n: int = 4) -> list[ScoredTrajectory]:
    out = []
    for g in range(k):
        for i in range(n):
            out.append(
                ScoredTrajectory(
                    uid=f"u{g}",
                    trajectory_id=f"u{g}/{i}",
                    sample_index=i,
                    attempt_id="a",
                    data_source="t",
                    prompt_ids=[11, 12 + g, 13],
                    response_ids=[21 + i, 40 + g, 41],
                    response_mask=[1, 1, 1],
                    response_logprobs=[-5.0, -5.0, -5.0],
                    num_turns=2,
                    reward_score=float(i % 2),
                    finish_reason="length" if i == 3 else "stop",
                    extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
                )
            )
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from pipeline.harness.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("ppo") / "tiny", preset="tiny", seed=0)


def _step(tiny, **cfg):
    from transformers import AutoModelForCausalLM

    from schemas.advantages import grpo_advantages
    from workers.trainer.step import train_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    config = TrainerConfig(lr=5e-2, micro_batch_size=4, **cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    samples = _samples()
    adv = grpo_advantages([s.reward_score for s in samples], [s.uid for s in samples])
    return train_step(model, optimizer, collate(samples, adv), config)


def test_one_update_per_step_never_clips(tiny) -> None:
    metrics = _step(tiny)
    assert metrics["optimizer_updates"] == 1.0 and metrics["pg_clipfrac"] == 0.0
    assert metrics["ppo_kl"] == 0.0


def test_the_clip_acts_across_mini_batches(tiny) -> None:
    metrics = _step(tiny, ppo_mini_batches=4, ppo_epochs=2)
    updates = metrics["updates"]
    assert metrics["optimizer_updates"] == 8.0 and len(updates) == 8
    assert [(u["epoch"], u["mini_batch"]) for u in updates[:5]] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
    ]
    assert updates[0]["pg_clipfrac"] == 0.0 and updates[0]["ppo_kl"] == pytest.approx(0, abs=1e-6)
    assert metrics["pg_clipfrac"] > 0  # the policy moved away from the proximal one
    assert any(u["ppo_kl"] != 0 for u in updates[1:])


def test_mini_batches_hold_whole_groups() -> None:
    from workers.trainer.step import mini_batches

    batch = collate(_samples(k=5, n=3))
    parts = mini_batches(batch, 2)
    assert [len(p) for p in parts] == [6, 9]
    assert [set(p.uids) for p in parts] == [{"u0", "u1"}, {"u2", "u3", "u4"}]
    assert [len(p) for p in mini_batches(batch, 50)] == [3] * 5


def test_masking_truncated_responses_leaves_them_out(tiny) -> None:
    metrics = _step(tiny, mask_truncated=True)
    assert metrics["tokens"] == 4 * 3 * 3  # of 4 × 4 samples of 3 tokens, one per group cut


def test_a_step_without_advantage_is_flagged(tiny) -> None:
    from transformers import AutoModelForCausalLM

    from workers.trainer.step import train_step

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    config = TrainerConfig(micro_batch_size=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert train_step(model, optimizer, collate(_samples()), config)["zero_advantage"] == 1.0
