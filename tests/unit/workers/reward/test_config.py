"""`RewardConfig.unscorable`: what `rollout produce` refuses before any compute is spent."""

from __future__ import annotations

from workers.reward.config import CustomRewardConfig, RewardConfig


def test_a_rule_scorer_needs_a_known_data_source_and_a_ground_truth() -> None:
    rule = RewardConfig()
    assert rule.unscorable("openai/gsm8k", "42") is None
    assert rule.unscorable("openai/gsm8k", 0) is None  # a falsy truth is a truth
    missing = rule.unscorable("openai/gsm8k", None)
    assert missing is not None and "needs reward_model.ground_truth" in missing
    unknown = rule.unscorable("my/dataset", "1")
    assert unknown is not None and "no scorer for data_source 'my/dataset'" in unknown
    assert "reward.custom" in unknown


def test_a_custom_function_scores_any_prompt() -> None:
    custom = RewardConfig(custom=CustomRewardConfig(path="mypkg.reward", name="score"))
    assert custom.unscorable("my/dataset", None) is None
