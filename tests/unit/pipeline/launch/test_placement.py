"""Replica sizing: world_size = TP x DP x PP, replicas = total_gpus // world_size."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.launch.placement import ReplicaPlacementConfig, RolloutMode


@pytest.mark.parametrize(
    ("tp", "dp", "pp", "nnodes", "gpn", "ws", "replicas", "per_node", "nodes_per"),
    [
        (1, 1, 1, 1, 8, 1, 8, 8, 1),
        (2, 1, 1, 1, 8, 2, 4, 4, 1),
        (2, 2, 1, 2, 8, 4, 4, 2, 1),
        (4, 1, 2, 2, 8, 8, 2, 1, 1),
        (8, 1, 2, 4, 8, 16, 2, 0, 2),
        (8, 2, 2, 4, 8, 32, 1, 0, 4),
    ],
)
def test_sizing(tp, dp, pp, nnodes, gpn, ws, replicas, per_node, nodes_per) -> None:
    cfg = ReplicaPlacementConfig(
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        pipeline_parallel_size=pp,
        nnodes=nnodes,
        gpus_per_node=gpn,
    )
    assert cfg.world_size == ws
    assert cfg.replicas == cfg.max_replicas == replicas
    assert cfg.replicas_per_node == per_node
    assert cfg.nodes_per_replica == nodes_per


def test_replica_gpus_pack_node_by_node() -> None:
    cfg = ReplicaPlacementConfig(tensor_parallel_size=4, nnodes=2, gpus_per_node=8)
    assert cfg.replicas == 4
    assert cfg.replica_gpus(0) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert cfg.replica_gpus(3) == [(1, 4), (1, 5), (1, 6), (1, 7)]
    with pytest.raises(IndexError):
        cfg.replica_gpus(4)
    span = ReplicaPlacementConfig(tensor_parallel_size=16, nnodes=2, gpus_per_node=8)
    assert {n for n, _ in span.replica_gpus(0)} == {0, 1}


def test_standalone_may_leave_gpus_spare_and_run_fewer() -> None:
    cfg = ReplicaPlacementConfig(tensor_parallel_size=2, nnodes=1, gpus_per_node=8, num_replicas=3)
    assert cfg.replicas == 3 and cfg.max_replicas == 4


def test_cpu_replicas() -> None:
    cfg = ReplicaPlacementConfig(gpus_per_node=0, num_replicas=2)
    assert cfg.replicas == 2 and cfg.replica_gpus(1) == []
    with pytest.raises(ValidationError, match="need num_replicas"):
        ReplicaPlacementConfig(gpus_per_node=0)
    with pytest.raises(ValidationError, match="cannot be tensor"):
        ReplicaPlacementConfig(gpus_per_node=0, num_replicas=1, tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_size": 16, "gpus_per_node": 8}, "exceeds"),
        ({"tensor_parallel_size": 3, "gpus_per_node": 8}, "straddle"),
        ({"tensor_parallel_size": 12, "nnodes": 2, "gpus_per_node": 8}, "multiple of"),
        ({"tensor_parallel_size": 2, "gpus_per_node": 8, "num_replicas": 5}, "that fit"),
        ({"tensor_parallel_size": 0}, "greater than or equal"),
        ({"tp": 2}, "Extra inputs"),
    ],
)
def test_invalid(kwargs, match) -> None:
    with pytest.raises(ValidationError, match=match):
        ReplicaPlacementConfig(**kwargs)


def test_standalone_colocated_and_hybrid_are_the_modes() -> None:
    cfg = ReplicaPlacementConfig.model_validate({"mode": "standalone", "tensor_parallel_size": 2})
    assert cfg.mode is RolloutMode.STANDALONE and cfg.replicas == 4
    assert [m.value for m in RolloutMode] == ["standalone", "colocated", "hybrid"]


def test_colocated_replicas_take_no_gpus_of_their_own() -> None:
    # Two judge replicas beside the trainer of a 1-GPU node: they do not count against it.
    cfg = ReplicaPlacementConfig(mode="colocated", gpus_per_node=1, num_replicas=2)
    assert cfg.mode is RolloutMode.COLOCATED and cfg.replicas == cfg.max_replicas == 2
    cpu = ReplicaPlacementConfig(mode="colocated", gpus_per_node=0, num_replicas=3)
    assert cpu.replicas == 3
    with pytest.raises(ValidationError, match=r"colocated replicas .* need num_replicas"):
        ReplicaPlacementConfig(mode="colocated", gpus_per_node=8)
    with pytest.raises(ValidationError, match="exceeds a node's 8 GPUs"):
        ReplicaPlacementConfig(
            mode="colocated", gpus_per_node=8, nnodes=2, tensor_parallel_size=16, num_replicas=1
        )


def test_hybrid_sizes_the_standalone_replicas_the_lent_trainer_takes_no_gpu() -> None:
    hybrid = ReplicaPlacementConfig(mode="hybrid", gpus_per_node=8, tensor_parallel_size=2)
    standalone = ReplicaPlacementConfig(gpus_per_node=8, tensor_parallel_size=2)
    assert hybrid.mode is RolloutMode.HYBRID
    assert (hybrid.replicas, hybrid.replica_gpus(3)) == (4, standalone.replica_gpus(3))
    with pytest.raises(ValidationError, match="need num_replicas"):
        ReplicaPlacementConfig(mode="hybrid", gpus_per_node=0)
