"""`StageLoopConfig`: the reward and replay stages' loop settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.replay.config import ReplayConfig
from workers.reward.config import RewardConfig


def test_each_stage_keeps_its_defaults() -> None:
    reward, replay = RewardConfig(), ReplayConfig()
    assert reward.loop_settings()["group_id"] == reward.group_id == "rollout-reward"
    assert (reward.batch_size, reward.sweep_interval_s) == (1024, 30.0)
    assert replay.loop_settings()["group_id"] == replay.group_id == "rollout-replay"
    assert (replay.batch_size, replay.sweep_interval_s) == (256, 5.0)
    assert reward.changelog_topic == "rollout-reward-trajectories-changelog"
    assert replay.changelog_topic == "rollout-replay-groups-changelog"


def test_the_faust_era_names_are_gone() -> None:
    with pytest.raises(ValidationError, match="app_id"):
        RewardConfig.model_validate({"app_id": "r1"})
    with pytest.raises(ValidationError, match="tick_interval_s"):
        ReplayConfig.model_validate({"tick_interval_s": 2})
    replay = ReplayConfig(group_id="p2", sweep_interval_s=1)
    assert replay.loop_settings()["group_id"] == "p2" and replay.sweep_interval_s == 1.0


def test_unknown_keys_and_bad_values_are_still_refused() -> None:
    with pytest.raises(ValidationError):
        RewardConfig.model_validate({"group": "x"})
    with pytest.raises(ValidationError):
        ReplayConfig.model_validate({"group_id": "has space"})
    with pytest.raises(ValidationError, match="sweep_interval_s"):
        ReplayConfig(group_timeout_s=2, sweep_interval_s=5)
