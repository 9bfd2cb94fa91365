"""The launch plan is the same list of CLI commands for the local and the Ray launcher."""

from __future__ import annotations

import pytest

from pipeline.cli.main import build_parser
from pipeline.launch.local import StagePlan


def test_every_planned_command_parses_in_the_cli() -> None:
    plan = StagePlan(model_dir="/m", agent_loop_workers=2).processes([8001, 8002])
    names = [name for name, _ in plan]
    assert names == [
        "replica-0",
        "sync-0",
        "replica-1",
        "sync-1",
        "agent-loop-0",
        "agent-loop-1",
        "reward",
        "replay",
        "train",
    ]
    parser = build_parser()
    for _, argv in plan:
        parser.parse_args(argv)  # exits (SystemExit) on an unknown command or flag


def test_one_worker_keeps_the_plain_name_and_unknown_stages_are_refused() -> None:
    plan = StagePlan(model_dir="/m", stages=("agent-loop",)).processes([])
    assert plan == [("agent-loop", ["worker", "agent-loop", "--model", "/m"])]
    with pytest.raises(ValueError, match="unknown stage"):
        StagePlan(model_dir="/m", stages=("nope",)).processes([])
