"""The Ray launcher's pure parts: resources per stage, replica sizing, its CLI; no Ray here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.cli.main import build_parser
from pipeline.launch.local import StagePlan
from pipeline.launch.ray.stages import (
    LaunchError,
    replica_world_size,
    stage_resources,
    trainer_gpus,
)


def test_replicas_ask_for_their_threads_on_cpu_and_their_world_size_in_gpus() -> None:
    assert stage_resources("replica-0", backend="hf", world_size=1, replica_threads=2) == (2, 0)
    assert stage_resources("replica-1", backend="vllm", world_size=4, replica_threads=2) == (1, 4)
    assert stage_resources("train", backend="vllm", world_size=4, replica_threads=1) == (1, 0)
    for light in ("sync-0", "agent-loop", "agent-loop-1", "reward", "replay"):
        assert stage_resources(light, backend="hf", world_size=1, replica_threads=1) == (0, 0)


def test_the_trainer_asks_for_a_gpu_when_it_trains_on_one() -> None:
    assert stage_resources(
        "train", backend="hf", world_size=1, replica_threads=1, trainer_gpus=1
    ) == (1, 1)
    assert trainer_gpus("cpu", [8]) == 0
    assert trainer_gpus("auto", [0, 0]) == 0 and trainer_gpus("auto", [0, 4]) == 1
    assert trainer_gpus("cuda", [1]) == 1 and trainer_gpus("cuda:0", [1]) == 1
    with pytest.raises(LaunchError, match="sees as cuda:0"):
        trainer_gpus("cuda:1", [8])
    with pytest.raises(LaunchError, match="all taken by the replicas"):
        trainer_gpus("cuda", [0])
    assert trainer_gpus("auto", [4, 4], replica_gpus=7) == 1
    assert trainer_gpus("auto", [4, 4], replica_gpus=8) == 0  # the replicas fill the cluster
    with pytest.raises(LaunchError, match="8 free GPUs are all taken by the replicas"):
        trainer_gpus("cuda", [4, 4], replica_gpus=8)


def test_replica_sizing_follows_the_placement_rules() -> None:
    assert replica_world_size("hf", (1, 1, 1), 3, []) == 1
    assert replica_world_size("vllm", (2, 2, 1), 4, [8, 8]) == 4
    with pytest.raises(LaunchError, match="runs on CPU"):
        replica_world_size("hf", (2, 1, 1), 1, [8])
    with pytest.raises(LaunchError, match="has none"):
        replica_world_size("vllm", (1, 1, 1), 1, [0, 0])
    with pytest.raises(LaunchError, match="do not fit"):
        replica_world_size("vllm", (4, 1, 1), 5, [8, 8])
    with pytest.raises(LaunchError, match="spanning nodes"):
        replica_world_size("vllm", (16, 1, 1), 1, [8, 8])


def test_the_fit_check_counts_each_nodes_own_replicas() -> None:
    """Nodes of 8 and 2 GPUs hold two replicas of 4 (the 2-GPU node none), not four."""
    assert replica_world_size("vllm", (4, 1, 1), 2, [8, 2]) == 4
    with pytest.raises(LaunchError, match="nodes of 8, 2 GPUs hold 2") as err:
        replica_world_size("vllm", (4, 1, 1), 4, [8, 2])
    assert "\n" not in str(err.value)
    assert replica_world_size("vllm", (2, 1, 1), 3, [4, 2]) == 2  # 2 + 1
    with pytest.raises(LaunchError, match="hold 3"):
        replica_world_size("vllm", (2, 1, 1), 4, [4, 3])  # a node of 3 holds one of 2


def test_a_vllm_plan_and_the_up_and_down_commands_parse() -> None:
    parser = build_parser()
    plan = StagePlan(
        model_dir="/m", backend="vllm", replica_args=("--tp", "2", "--dp", "1", "--pp", "1")
    ).processes([8001])
    serve = parser.parse_args(plan[0][1])
    assert (serve.backend, serve.tp, serve.dp, serve.pp) == ("vllm", 2, 1, 1)
    up = parser.parse_args(["up", "--ray", "--replicas", "3", "--steps", "5", "--wait"])
    assert (up.ray, up.replicas, up.steps, up.wait, up.run) == ("", 3, 5, True, None)
    assert parser.parse_args(["up", "--ray", "10.0.0.1:6379"]).ray == "10.0.0.1:6379"
    down = parser.parse_args(["down", "--ray", "10.0.0.1:6379", "--run", "exp1"])
    assert (down.ray, down.run) == ("10.0.0.1:6379", "exp1")
    local = parser.parse_args(["up", "--steps", "5"])  # without --ray: here, in the foreground
    assert (local.ray, local.steps, local.timeout) == (None, 5, None)
    down = parser.parse_args(["down", "--run-dir", "runs/x"])  # like up: here by default
    assert (down.ray, down.run_dir) == (None, "runs/x")
    assert parser.parse_args(["down", "--ray"]).ray == ""  # the local Ray instance
    assert parser.parse_args(["down", "--local"]).ray is None  # the old spelling still works


def test_the_launcher_modules_import_without_ray() -> None:
    code = (
        "import sys, pipeline.launch.ray.stages, pipeline.launch.ray.actor,"
        " pipeline.launch.ray.child;"
        "print(','.join(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
