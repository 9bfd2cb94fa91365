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


def test_a_judge_pool_from_config_is_replicas_of_role_judge_without_sync() -> None:
    from pipeline.config import load_config
    from pipeline.launch.local import judge_plan

    cfg = load_config(
        None, {"reward": {"judge": {"enable": True, "model": "/judge", "replicas": 2}}}
    )
    assert judge_plan(load_config(None, {})) == {}
    layout = StagePlan(model_dir="/m", **judge_plan(cfg))
    plan = layout.processes([8001], metrics_ports={"reward": 9001}, judge_ports=[8101, 8102])
    names = [name for name, _ in plan]
    assert names == ["replica-0", "sync-0", "judge-0", "judge-1", "agent-loop", "reward",
                     "replay", "train"]  # fmt: skip
    argv = dict(plan)["judge-1"]
    assert argv[argv.index("--model") + 1] == "/judge" and argv[argv.index("--port") + 1] == "8102"
    assert argv[-2:] == ["--role", "judge"] and "--register" in argv
    assert not any(name.startswith("sync-") and "8101" in " ".join(a) for name, a in plan)
    parser = build_parser()
    for _, argv in plan:
        parser.parse_args(argv)
    with pytest.raises(ValueError, match="2 judge replicas, 1 ports"):
        layout.processes([8001], judge_ports=[8101])
    with pytest.raises(ValueError, match="no process takes --metrics-port: judge-0"):
        layout.processes([8001], metrics_ports={"judge-0": 1}, judge_ports=[8101, 8102])
