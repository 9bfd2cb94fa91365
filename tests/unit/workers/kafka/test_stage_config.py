"""`StageLoopConfig`: the reward and replay stages' loop settings, and their old names."""

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


def test_the_old_names_are_still_read() -> None:
    assert RewardConfig.model_validate({"app_id": "r1"}).group_id == "r1"
    replay = ReplayConfig.model_validate({"app_id": "p1", "tick_interval_s": 2})
    assert (replay.group_id, replay.sweep_interval_s) == ("p1", 2.0)
    assert ReplayConfig(group_id="p2", sweep_interval_s=1).loop_settings()["group_id"] == "p2"


def test_unknown_keys_and_bad_values_are_still_refused() -> None:
    with pytest.raises(ValidationError):
        RewardConfig.model_validate({"group": "x"})
    with pytest.raises(ValidationError):
        ReplayConfig.model_validate({"group_id": "has space"})
    with pytest.raises(ValidationError, match="sweep_interval_s"):
        ReplayConfig(group_timeout_s=2, sweep_interval_s=5)
