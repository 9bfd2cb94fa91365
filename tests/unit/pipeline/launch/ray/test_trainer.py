"""`rollout train --nproc N --ray`: the torchrun variables each rank's actor gets, and its GPUs."""

from __future__ import annotations

import pytest

from pipeline.launch.ray.stages import LaunchError
from pipeline.launch.ray.trainer import rank_env, rank_gpus


def _place(node: str, ip: str, port: int = 0, gpus: tuple[str, ...] = ()) -> dict[str, object]:
    return {"node_id": node, "ip": ip, "port": port, "gpus": list(gpus)}


def test_cpu_ranks_on_one_node_are_torchrun_standalone_and_see_no_gpu() -> None:
    envs = rank_env([_place("n1", "10.0.0.1", 29600), _place("n1", "10.0.0.1", 41000)])
    assert envs == [
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29600",
            "CUDA_VISIBLE_DEVICES": "",
        },
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29600",
            "CUDA_VISIBLE_DEVICES": "",
        },
    ]


def test_gpu_ranks_across_nodes_see_their_node_peers_and_their_own_gpu_first_by_local_rank() -> (
    None
):
    places = [
        _place("a", "10.0.0.1", 29600, ("3",)),
        _place("b", "10.0.0.2", 1, ("0",)),
        _place("a", "10.0.0.1", 2, ("1",)),
        _place("b", "10.0.0.2", 3, ("5",)),
    ]
    envs = rank_env(places)
    assert [e["MASTER_ADDR"] + ":" + e["MASTER_PORT"] for e in envs] == ["10.0.0.1:29600"] * 4
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"),
        ("1", "0", "2"),
        ("2", "1", "2"),
        ("3", "1", "2"),
    ]
    # cuda:LOCAL_RANK of each is the GPU Ray granted it, and its node's peers are visible
    for env, place in zip(envs, places, strict=True):
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(env["LOCAL_RANK"])] == place["gpus"][0]  # type: ignore[index]
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == envs[2]["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert envs[1]["CUDA_VISIBLE_DEVICES"] == "0,5"


def test_a_gpu_each_only_where_the_trainer_trains_on_gpus_and_the_cluster_has_them() -> None:
    assert rank_gpus("cpu", 2, 8) == 0
    assert rank_gpus("auto", 2, 8) == 1
    assert rank_gpus("auto", 4, 2) == 0  # too few: gloo on CPUs, as auto means
    assert rank_gpus("cuda", 2, 2) == 1
    with pytest.raises(LaunchError, match="2 GPU ranks asked for and the Ray cluster has 1"):
        rank_gpus("cuda", 2, 1)
    with pytest.raises(LaunchError, match=r"use trainer\.device=cuda"):
        rank_gpus("cuda:1", 2, 8)
