"""`rollout bench learn`: the per-run figures from a step log, by hand."""

from __future__ import annotations

import pytest

from pipeline.harness.bench.learn import summarize_run


def _steps(rewards: list[float], **extra: float) -> list[dict[str, float]]:
    return [
        {"step": i + 1, "time": 100.0 + 2 * i, "reward_mean": r, **extra}
        for i, r in enumerate(rewards)
    ]


def test_a_run_that_learns() -> None:
    rewards = [0.1] * 5 + [0.3] * 10 + [0.5] * 5  # 20 steps: 10% windows of 2
    out = summarize_run(_steps(rewards, zero_advantage=0.0), launched=90.0, target=0.4)
    assert (out["first"], out["last"]) == pytest.approx((0.1, 0.5))
    assert out["learned"] and not out["collapsed"]
    # The mean of the last 5 steps first reaches 0.4 at step 18 (0.3, 0.3, 0.5, 0.5, 0.5).
    assert out["time_to_reward_s"] == pytest.approx(100 + 2 * 17 - 90)
    assert out["wall_s"] == pytest.approx(100 + 2 * 19 - 90)


def test_a_run_that_collapses() -> None:
    out = summarize_run(_steps([0.2] * 10 + [0.0] * 10, zero_advantage=1.0), launched=100.0)
    assert out["collapsed"] and not out["learned"] and out["time_to_reward_s"] is None
    assert out["zero_advantage_steps"] == 20
    low = summarize_run(_steps([0.01] * 10 + [0.03] * 10), launched=100.0)
    assert low["collapsed"]  # up, but below 0.05
