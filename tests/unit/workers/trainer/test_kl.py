"""The KL term's numerics (issue 42): k3 clamps before its exponential, as verl's
`low_var_kl` does, and masked positions (tool tokens, padding) never enter its arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from workers.trainer.loss import kl_penalty, policy_loss


def _loss(log_prob: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    zeros = torch.zeros_like(ref)
    return policy_loss(
        log_prob,
        log_prob.detach(),
        log_prob.detach(),
        zeros,
        mask,
        ref_log_prob=ref,
        kl_coef=0.5,
        kl_loss_type=kind,
    ).loss


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_a_masked_position_far_from_the_reference_leaves_the_gradient_finite(kind: str) -> None:
    """Position 1 is a tool token (mask 0) whose logprob is 100 nats below the reference's:
    exp(100) overflowed in k3, and 0 · inf made every gradient NaN."""
    log_prob = torch.tensor([[-1.0, -120.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -20.0, -1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    _loss(log_prob, ref, mask, kind).backward()
    assert log_prob.grad is not None
    assert torch.isfinite(log_prob.grad).all(), log_prob.grad
    assert log_prob.grad[0, 1].item() == 0.0  # a masked position has no say
    assert log_prob.grad[0, 0].item() != 0.0


def test_k3_clamps_before_the_exponential_like_verl() -> None:
    """verl: d = clamp(ref − logp, ±20); kl = exp(d) − d − 1, clamped to ±10."""
    log_prob = torch.tensor([[-120.0, -1.0, 5.0]], requires_grad=True)
    ref = torch.tensor([[-20.0, -1.2, -30.0]])
    kl = kl_penalty(log_prob, ref, "k3")
    d = [max(-20.0, min(20.0, r - lp)) for r, lp in ((-20.0, -120.0), (-1.2, -1.0), (-30.0, 5.0))]
    want = [max(-10.0, min(10.0, math.exp(x) - x - 1)) for x in d]
    assert kl.tolist()[0] == pytest.approx(want, rel=1e-6)
    kl.sum().backward()
    assert log_prob.grad is not None and torch.isfinite(log_prob.grad).all()


def test_k1_and_k2_are_not_clamped() -> None:
    """verl clamps only low_var_kl; `kl` and `mse` are the raw estimates."""
    log_prob, ref = torch.tensor([[0.0, -60.0]]), torch.tensor([[-50.0, 0.0]])
    assert kl_penalty(log_prob, ref, "k1").tolist() == [[50.0, -60.0]]
    assert kl_penalty(log_prob, ref, "k2").tolist() == [[1250.0, 1800.0]]
