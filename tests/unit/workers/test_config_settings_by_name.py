"""Settings handed on by name: the config fields a pure function receives are pinned here.

`workers.trainer.step` passes `policy_loss` every `TrainerConfig` field that bears the name of
one of its keyword arguments, and `workers.replay.batch` does the same for `judge` with
`ReplayConfig`; a field added, renamed or removed on either side shows up here.
"""

from __future__ import annotations


def test_the_loss_receives_every_loss_knob_of_the_trainer_config() -> None:
    from workers.trainer.step import _LOSS_SETTINGS

    assert _LOSS_SETTINGS == {
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "rollout_is_threshold",
        "rollout_is_level",
        "entropy_coeff",
        "kl_coef",
        "kl_loss_type",
        "loss_agg_mode",
    }


def test_judge_receives_every_group_rule_of_the_replay_config() -> None:
    from workers.replay.batch import _JUDGE_SETTINGS

    assert _JUDGE_SETTINGS == {
        "max_staleness",
        "stale_policy",
        "drop_zero_variance",
        "norm_adv_by_std",
        "partial_policy",
        "adv_eps",
    }
