"""Replay stage: table state encoding, config checks, the judge's partial policy."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from schemas import ScoredTrajectory
from workers.replay.config import ReplayConfig
from workers.replay.groups import PendingGroup, judge
from workers.replay.state import GroupState, group_key, is_group_key, sample_key


def scored(uid: str, index: int, reward: float, low: int = 0) -> ScoredTrajectory:
    return ScoredTrajectory(
        uid=uid,
        trajectory_id=f"{uid}/{index}",
        sample_index=index,
        attempt_id="a",
        data_source="openai/gsm8k",
        prompt_ids=[1],
        response_ids=[3],
        response_mask=[1],
        response_logprobs=[-0.1],
        num_turns=2,
        reward_score=reward,
        extra_fields={"min_global_steps": low, "max_global_steps": low},
    )


def test_group_state_lifecycle_round_trips() -> None:
    state = GroupState(uid="u/x", partition=3, first_seen=12.5, expected=4, indices=[2, 0])
    assert GroupState.from_bytes(state.to_bytes()) == GroupState(
        uid="u/x", partition=3, first_seen=12.5, expected=4, indices=[0, 2]
    )
    assert not state.complete and state.unfinished
    state.mark_emitting("stale", 1, 42)
    back = GroupState.from_bytes(state.to_bytes())
    assert (back.status, back.verdict, back.out_partition, back.since) == (
        "emitting",
        "stale",
        1,
        42,
    )
    back.reopen()
    assert (back.status, back.verdict, back.since) == ("pending", None, None)
    state.mark_done()
    done = GroupState.from_bytes(state.to_bytes())
    assert (done.status, done.outcome, done.unfinished) == ("done", "stale", False)
    assert done.sample_ids() == ["u/x/0", "u/x/2"]
    with pytest.raises(ValueError):
        GroupState.from_bytes(b"RT1...")


def test_keys_do_not_collide() -> None:
    assert is_group_key(group_key("a")) and not is_group_key(sample_key("a/0"))
    assert group_key("s") != sample_key("s")


def test_config_checks() -> None:
    assert ReplayConfig().changelog_topic == "rollout-replay-groups-changelog"
    with pytest.raises(ValidationError, match="drop_zero_variance needs n >= 2"):
        ReplayConfig(n=1, drop_zero_variance=True)
    with pytest.raises(ValidationError, match="sweep_interval_s must not exceed"):
        ReplayConfig(group_timeout_s=2, sweep_interval_s=5)
    with pytest.raises(ValidationError):
        ReplayConfig(max_staleness=-1)
    with pytest.raises(ValidationError):
        ReplayConfig(partial_policy="keep")


def test_config_imports_no_kafka_client() -> None:
    code = (
        "import sys, workers.replay, workers.replay.config;"
        "print('aiokafka' in sys.modules or 'kafka' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_partial_policy_and_single_sample_variance() -> None:
    group = PendingGroup("p", 4, 0.0, {0: scored("p", 0, 1.0), 2: scored("p", 2, 0.0, low=1)})
    kw = {
        "current_version": 9,
        "max_staleness": 2,
        "stale_policy": "drop",
        "norm_adv_by_std": False,
    }
    assert judge(group, drop_zero_variance=False, partial_policy="drop", **kw).drop == "timeout"
    emitted = judge(group, drop_zero_variance=False, partial_policy="emit", **kw)
    assert emitted.drop == "stale" and emitted.staleness == 9
    fresh = judge(group, drop_zero_variance=False, **{**kw, "current_version": 1})
    assert fresh.drop is None and fresh.group is not None
    assert fresh.group.advantages == [0.5, -0.5]
    one = PendingGroup("o", 4, 0.0, {1: scored("o", 1, 1.0)})
    flat = judge(one, drop_zero_variance=True, **{**kw, "current_version": 0})
    assert flat.drop == "zero_variance"
