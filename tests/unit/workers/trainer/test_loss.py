"""The policy loss against values computed by hand (clip, truncated IS weights, masks)."""

from __future__ import annotations

import math

import pytest
import torch

from workers.trainer.loss import importance_weights, policy_loss, summarize


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_ppo_clip_by_hand() -> None:
    # ratios r = [1.5, 0.5, 1.1, 0.5] against the proximal policy; behaviour = proximal (w = 1).
    old = _t([-1.0, -1.0, -1.0, -1.0, -1.0])
    ratios = [1.5, 0.5, 1.1, 0.5, 7.0]
    logp = (old + torch.log(_t(ratios))).requires_grad_(True)
    adv = _t([1.0, 1.0, -1.0, -1.0, 5.0])
    mask = _t([1, 1, 1, 1, 0])  # the last token is a tool token: no effect at all
    out = policy_loss(logp, old, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # t0: max(-1.5, -1.2) = -1.2 (clipped)   t1: max(-0.5, -0.8) = -0.5
    # t2: max(1.1, 1.1) = 1.1                t3: max(0.5, 0.8) = 0.8 (clipped)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    assert out.metrics["pg_clipfrac_sum"] / out.metrics["tokens"] == pytest.approx(0.5)
    out.loss.backward()
    # d/dlogp of -A·r is -A·r where unclipped, 0 where the clipped branch is taken or masked.
    expected = [0.0, -0.5 / 4, 1.1 / 4, 0.0, 0.0]
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx(expected)


def test_asymmetric_clip_high() -> None:
    old = _t([0.0, 0.0])
    logp = old + torch.log(_t([1.25, 0.75]))
    adv = _t([1.0, -1.0])
    out = policy_loss(logp, old, old, adv, _t([1, 1]), clip_ratio_low=0.2, clip_ratio_high=0.28)
    # t0: r=1.25 < 1.28, not clipped: -1.25.  t1: A<0, r=0.75 < 0.8: max(0.75, 0.8) = 0.8
    assert out.loss.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert out.metrics["pg_clipfrac_sum"] == 1.0


def test_truncated_token_weights_by_hand() -> None:
    # proximal = current (one update per step): r = 1, the loss is -A·w with w = min(ρ, C).
    logp = _t([-1.0, -1.0, -1.0]).requires_grad_(True)
    behav = _t([-1.0 - math.log(0.5), -1.0 - math.log(3.0), -1.0])  # ρ = [0.5, 3, 1]
    adv = _t([1.0, 1.0, 1.0])
    mask = _t([1, 1, 1])
    out = policy_loss(logp, logp.detach(), behav, adv, mask, rollout_is_threshold=2.0)
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0 + 1.0) / 3)
    m = summarize([out.metrics])
    assert m["is_weight_mean"] == pytest.approx(3.5 / 3)
    assert m["is_weight_min"] == pytest.approx(0.5)
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_weight_raw_max"] == pytest.approx(3.0)
    assert m["is_truncated_frac"] == pytest.approx(1 / 3)
    assert m["pg_clipfrac"] == 0.0
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-0.5 / 3, -2.0 / 3, -1.0 / 3])


def test_sequence_and_geometric_weights_by_hand() -> None:
    prox = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    # row 0: ρ = [0.5, 3, 1] → product 1.5; row 1: ρ = [2, 2, 1000] with the last masked.
    behav = prox - torch.log(torch.tensor([[0.5, 3.0, 1.0], [2.0, 2.0, 1000.0]]).double())
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    w, raw = importance_weights(prox, behav, mask, cap=2.0, level="sequence")
    assert w[0].tolist() == pytest.approx([1.5, 1.5, 1.5])
    assert w[1].tolist() == pytest.approx([2.0, 2.0, 0.0])  # product 4 truncated to 2
    assert raw[1, 0].item() == pytest.approx(4.0)
    w, _ = importance_weights(prox, behav, mask, cap=2.0, level="geometric")
    assert w[0, 0].item() == pytest.approx(1.5 ** (1 / 3))
    assert w[1, 0].item() == pytest.approx(2.0)  # (2·2)^(1/2)
    w, _ = importance_weights(prox, behav, mask, cap=2.0, level="token")
    assert w.flatten().tolist() == pytest.approx([0.5, 2.0, 1.0, 2.0, 2.0, 0.0])
    # the sequence-level loss with A = 1 and r = 1: -(1.5·3 + 2·2) / 5 tokens
    out = policy_loss(prox, prox, behav, torch.ones_like(prox), mask, rollout_is_level="sequence")
    assert out.loss.item() == pytest.approx(-(1.5 * 3 + 2.0 * 2) / 5)


def test_mask_and_micro_batches_add_up_to_the_token_mean() -> None:
    torch.manual_seed(0)
    logp = -torch.rand(4, 6, dtype=torch.float64)
    prox = logp - 0.1 * torch.randn(4, 6, dtype=torch.float64)
    behav = logp - 0.3 * torch.randn(4, 6, dtype=torch.float64)
    adv = torch.randn(4, 1, dtype=torch.float64).expand(4, 6)
    mask = (torch.rand(4, 6) > 0.3).double()
    whole = policy_loss(logp, prox, behav, adv, mask).loss
    n = mask.sum().item()
    parts = sum(
        policy_loss(
            logp[i : i + 2],
            prox[i : i + 2],
            behav[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            token_count=n,
        ).loss
        for i in (0, 2)
    )
    assert float(parts) == pytest.approx(whole.item())
    # changing anything under mask = 0 changes nothing
    logp2, behav2 = logp.clone(), behav.clone()
    logp2[mask == 0] = 5.0
    behav2[mask == 0] = -50.0
    assert policy_loss(logp2, prox, behav2, adv, mask).loss.item() == pytest.approx(whole.item())


def test_entropy_bonus_and_shape_check() -> None:
    logp = _t([-1.0, -1.0])
    ent = _t([2.0, 4.0])
    out = policy_loss(logp, logp, logp, _t([1.0, 1.0]), _t([1, 1]), entropy=ent, entropy_coeff=0.1)
    assert out.loss.item() == pytest.approx(-1.0 - 0.1 * 3.0)
    assert summarize([out.metrics])["entropy"] == pytest.approx(3.0)
    with pytest.raises(ValueError):
        policy_loss(logp, logp, logp, _t([1.0]), _t([1, 1]))


def test_weights_are_one_on_policy() -> None:
    logp = -torch.rand(3, 5, dtype=torch.float64)
    out = policy_loss(logp, logp, logp, torch.ones(3, 5).double(), torch.ones(3, 5).double())
    m = summarize([out.metrics])
    assert m["is_weight_mean"] == pytest.approx(1.0)
    assert m["is_weight_min"] == pytest.approx(1.0) and m["is_weight_max"] == pytest.approx(1.0)
    assert m["behav_kl"] == pytest.approx(0.0)


def test_the_metric_keys_are_the_declared_ones() -> None:
    """`METRIC_KEYS` is what the sharded step gathers by: every call returns exactly those."""
    from workers.trainer.loss import METRIC_KEYS

    logp = torch.tensor([[-1.0, -2.0]])
    out = policy_loss(logp, logp, logp, torch.ones_like(logp), torch.ones_like(logp))
    assert sorted(out.metrics) == sorted(METRIC_KEYS)
