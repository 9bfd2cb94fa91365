"""DAPO's overlong buffer: the penalty by hand, and the run config's default budget."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.reward.overlong import OverlongConfig, overlong_penalty


def test_the_penalty_ramps_over_the_buffer_by_hand() -> None:
    cfg = OverlongConfig(buffer_len=4, penalty_factor=0.5, max_response_length=10)
    got = [overlong_penalty(n, cfg) for n in (0, 6, 7, 8, 10, 12)]
    assert got == pytest.approx([0, 0, -0.125, -0.25, -0.5, -0.5])


def test_off_by_default_and_without_a_budget() -> None:
    assert overlong_penalty(10**6, OverlongConfig()) == 0.0
    assert overlong_penalty(10**6, OverlongConfig(buffer_len=4)) == 0.0
    with pytest.raises(ValidationError, match="buffer_len"):
        OverlongConfig(buffer_len=11, max_response_length=10)


def test_the_run_config_takes_the_agent_loops_budget() -> None:
    from pipeline.config import RunConfig

    cfg = RunConfig(
        agent_loop={"sampling": {"max_tokens": 16}}, reward={"overlong": {"buffer_len": 4}}
    )
    assert cfg.reward.overlong.max_response_length == 16
    with pytest.raises(ValidationError, match="exceeds"):
        RunConfig(
            agent_loop={"sampling": {"max_tokens": 2}}, reward={"overlong": {"buffer_len": 4}}
        )
