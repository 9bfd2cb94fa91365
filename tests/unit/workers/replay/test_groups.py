"""Replay-stage logic: grouping, duplicates, timeouts, staleness, advantages."""

from __future__ import annotations

import math

import pytest

from schemas import ScoredTrajectory
from workers.replay.groups import GroupBuffer, PendingGroup, group_advantages, judge


def scored(
    uid: str, index: int, reward: float, low: int = 0, high: int | None = None
) -> ScoredTrajectory:
    return ScoredTrajectory(
        uid=uid,
        trajectory_id=f"{uid}/{index}",
        sample_index=index,
        attempt_id="a",
        data_source="openai/gsm8k",
        prompt_ids=[1, 2],
        response_ids=[3],
        response_mask=[1],
        response_logprobs=[-0.1],
        num_turns=2,
        reward_score=reward,
        extra_fields={"min_global_steps": low, "max_global_steps": low if high is None else high},
    )


def test_advantages_by_hand() -> None:
    # The sample std (n - 1), as verl's torch.std: [1, 0, 0, 1] has mean .5, std sqrt(1/3).
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt(4 * 0.25 / 3)
    assert adv == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], abs=1e-5)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], norm_by_std=False) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([2.0, 2.0]) == [0.0, 0.0]
    assert group_advantages([0.7]) == [0.0]  # no baseline, no signal
    three = group_advantages([3.0, 0.0, 0.0])  # mean 1, sample std sqrt(3)
    assert three[0] == pytest.approx(2 / math.sqrt(3), rel=1e-4)


def test_the_replay_group_and_the_consumer_batch_carry_the_same_advantages() -> None:
    """One definition: `judge` (rl.replay) and `grpo_advantages` (rl.scored batches)."""
    from workers.trainer.batching import grpo_advantages

    rewards = [1.0, 0.0, 0.25, 1.0, 0.0]
    pending = PendingGroup("u", expected=5)
    for i, r in enumerate(rewards):
        pending.samples[i] = scored("u", i, r)
    decision = judge(
        pending,
        current_version=0,
        max_staleness=None,
        stale_policy="keep",
        drop_zero_variance=False,
        norm_adv_by_std=True,
    )
    assert decision.group is not None
    assert decision.group.advantages == grpo_advantages(rewards, ["u"] * 5)


def test_group_completes_once_and_counts_duplicates() -> None:
    buf = GroupBuffer(default_n=3)
    assert buf.add(scored("u", 0, 1.0)) is None
    assert buf.add(scored("u", 0, 1.0)) is None  # redelivered
    assert buf.duplicates == 1
    assert buf.add(scored("u", 2, 0.0)) is None
    done = buf.add(scored("u", 1, 0.0))
    assert done is not None and sorted(done.samples) == [0, 1, 2]
    assert "u" not in buf.pending


def test_per_prompt_n_and_timeouts() -> None:
    buf = GroupBuffer(default_n=4)
    assert buf.add(scored("a", 0, 1.0), expected=1) is not None
    buf.add(scored("b", 0, 1.0))
    group = buf.pending["b"]
    assert buf.expired(10.0, now=group.first_seen + 5) == []
    assert [g.uid for g in buf.expired(10.0, now=group.first_seen + 11)] == ["b"]
    assert buf.pending == {}


def test_judge_staleness_and_zero_variance() -> None:
    buf = GroupBuffer(default_n=2)
    buf.add(scored("u", 0, 1.0, low=3, high=4))
    group = buf.add(scored("u", 1, 0.0, low=5))
    kw = {"stale_policy": "drop", "drop_zero_variance": True, "norm_adv_by_std": True}
    fresh = judge(group, current_version=5, max_staleness=2, **kw)
    assert fresh.drop is None and fresh.staleness == 2
    assert fresh.group.min_global_steps == 3 and fresh.group.max_global_steps == 5
    assert fresh.group.advantages == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-5)
    stale = judge(group, current_version=6, max_staleness=2, **kw)
    assert stale.drop == "stale" and stale.staleness == 3
    kept = judge(group, current_version=6, max_staleness=2, **{**kw, "stale_policy": "keep"})
    assert kept.drop is None

    same = GroupBuffer(default_n=2)
    same.add(scored("z", 0, 1.0))
    flat = judge(same.add(scored("z", 1, 1.0)), current_version=0, max_staleness=None, **kw)
    assert flat.drop == "zero_variance"
