"""Replica sizing and placement: how many inference replicas fit, and on which GPUs.

A replica is one inference server spanning `world_size = TP x DP x PP` GPUs. With
`total_gpus = nnodes x gpus_per_node`, the cluster holds `total_gpus // world_size` replicas.
A replica either fits inside one node (`replicas_per_node = gpus_per_node // world_size`) or
spans whole nodes (`nodes_per_replica = world_size // gpus_per_node`); one that straddles a node
boundary unevenly is rejected.

Mode (`RolloutMode`): `standalone`: replicas on their own GPUs; spare GPUs are allowed, and
`num_replicas` may ask for fewer than fit. `colocated`: separate replica processes on the
trainer's resources, serving another model (the LLM judge's pool, `reward.judge`: the
launchers start `num_replicas` of them beside the trainer, on Ray in the trainer's own bundle,
`pipeline.launch.ray.colocate`); they take no GPUs of their own, so `num_replicas` is
required and nothing is counted against `total_gpus`, but one must fit on a node. `hybrid`:
the standalone replicas, sized as above, plus the trainer's own engine inside the trainer
process, lent to generation while the trainer waits for groups (`trainer.lend.enable`, which
is what turns it on); that engine is counted nowhere: it is the trainer's resources.

`gpus_per_node = 0` means CPU replicas (the `hf` engine): no GPU arithmetic, `world_size` must
be 1 and `num_replicas` says how many. Pure module: no I/O, no torch.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ReplicaPlacementConfig", "RolloutMode"]


class RolloutMode(StrEnum):
    """Where the inference engines run relative to the trainer."""

    STANDALONE = "standalone"
    COLOCATED = "colocated"
    HYBRID = "hybrid"


class ReplicaPlacementConfig(BaseModel):
    """Sizing of the inference replicas; derived numbers are properties, checked at load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: RolloutMode = Field(
        default=RolloutMode.STANDALONE,
        description="standalone (own GPUs), colocated (on the trainer's: a judge's pool) or "
        "hybrid (standalone, plus the idle trainer lent to generation: `trainer.lend`).",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="TP degree of one replica.")
    data_parallel_size: int = Field(default=1, ge=1, description="DP degree of one replica.")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="PP degree of one replica.")
    nnodes: int = Field(default=1, ge=1, description="Nodes given to rollout (or shared).")
    gpus_per_node: int = Field(
        default=8, ge=0, description="GPUs per node; 0 means CPU replicas (the hf engine)."
    )
    num_replicas: int | None = Field(
        default=None, ge=1, description="Replicas to run; None = as many as fit (GPU only)."
    )

    @property
    def world_size(self) -> int:
        """GPUs (or processes) of one replica: TP x DP x PP."""
        return self.tensor_parallel_size * self.data_parallel_size * self.pipeline_parallel_size

    @property
    def total_gpus(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def max_replicas(self) -> int:
        """Replicas that fit on the GPUs (for CPU or colocated replicas: `num_replicas`)."""
        if self.gpus_per_node == 0 or self.mode is RolloutMode.COLOCATED:
            return self.num_replicas or 0
        return self.total_gpus // self.world_size

    @property
    def replicas(self) -> int:
        """Replicas to run."""
        return self.num_replicas if self.num_replicas is not None else self.max_replicas

    @property
    def replicas_per_node(self) -> int:
        """Replicas on one node; 0 when a replica spans several nodes (or CPU replicas)."""
        if self.gpus_per_node == 0 or self.world_size > self.gpus_per_node:
            return 0
        return self.gpus_per_node // self.world_size

    @property
    def nodes_per_replica(self) -> int:
        """Nodes one replica spans; 1 when it fits in one node."""
        if self.gpus_per_node == 0 or self.world_size <= self.gpus_per_node:
            return 1
        return self.world_size // self.gpus_per_node

    @model_validator(mode="after")
    def _check(self) -> ReplicaPlacementConfig:
        ws = self.world_size
        if self.mode is RolloutMode.COLOCATED:
            if self.num_replicas is None:
                raise ValueError(
                    "colocated replicas (on the trainer's resources) need num_replicas"
                )
            if self.gpus_per_node and ws > self.gpus_per_node:
                raise ValueError(
                    f"a colocated replica's world_size {ws} exceeds a node's {self.gpus_per_node}"
                    " GPUs: it runs beside the trainer, on one node"
                )
            return self
        if self.gpus_per_node == 0:
            if ws != 1:
                raise ValueError(
                    "CPU replicas (gpus_per_node=0) cannot be tensor/data/pipeline parallel"
                )
            if self.num_replicas is None:
                raise ValueError("CPU replicas (gpus_per_node=0) need num_replicas")
            return self
        if ws > self.total_gpus:
            raise ValueError(
                f"world_size {ws} (TP x DP x PP) exceeds the {self.total_gpus} GPUs "
                f"({self.nnodes} nodes x {self.gpus_per_node})"
            )
        if ws <= self.gpus_per_node and self.gpus_per_node % ws:
            raise ValueError(
                f"world_size {ws} does not divide gpus_per_node {self.gpus_per_node}: "
                "a replica would straddle two nodes"
            )
        if ws > self.gpus_per_node and ws % self.gpus_per_node:
            raise ValueError(
                f"world_size {ws} spans nodes but is not a multiple of gpus_per_node "
                f"{self.gpus_per_node}"
            )
        if self.num_replicas is not None and self.num_replicas > self.max_replicas:
            raise ValueError(
                f"num_replicas {self.num_replicas} > {self.max_replicas} that fit "
                f"({self.total_gpus} GPUs // world_size {ws})"
            )
        return self

    def replica_gpus(self, index: int) -> list[tuple[int, int]]:
        """The (node, local GPU) pairs of replica `index`, packed node by node."""
        if not 0 <= index < self.replicas:
            raise IndexError(f"replica {index} out of range 0..{self.replicas - 1}")
        if self.gpus_per_node == 0:
            return []
        start = index * self.world_size
        return [divmod(g, self.gpus_per_node) for g in range(start, start + self.world_size)]
