"""`WeightsConfig`: the run's `weights:` section, how a policy reaches the replicas.

`mode` chooses the way (`disk`: checkpoints the replicas read; `broadcast`: a process group
from the trainer); the rest are the broadcast way's parameters. The trainer (and
`PolicyPublisher`) reads all of it; a replica reads only `mode` (whether to wait for broadcast
weights before serving): what else it needs (address, group, timeout, backend) comes in the
grant the trainer writes, so a replica never disagrees with the trainer's settings. Imports
no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["WeightsConfig"]


class WeightsConfig(BaseModel):
    """The run's `weights` section: the way new weights reach the replicas, and the broadcast
    way's parameters. The trainer reads it; a replica gets what it needs in each grant."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["disk", "broadcast"] = Field(
        default="disk",
        description="How new weights reach the replicas. disk: each sync writes a checkpoint "
        "and replicas load it (`trainer.checkpoint_dir` must be storage every replica sees). "
        "broadcast: they come over a process group from the trainer (the parameters below), "
        "no shared disk needed; replicas start serving only once they hold the trainer's "
        "weights; one trainer process (trainer.nproc 1).",
    )

    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address of the trainer that every replica reaches: its rendezvous store "
        "and its end of each transfer's group listen there. Announced on the policy topic. "
        "Across machines, this machine's address on the network the replicas share: `rollout "
        "up --ray` sets the trainer's node's; a loopback one is refused in a run that spans "
        "nodes.",
    )
    port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Port of the rendezvous store; 0: a free one (it is announced).",
    )
    timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="How long the trainer waits for one replica's ranks to join, its group to "
        "form, a bucket to go out (on NCCL: to complete) or its receipt; a replica that misses "
        "it is dropped from that transfer and the trainer goes on with the others (one that "
        "did not join gets the next version from a checkpoint written for it).",
    )
    bucket_mb: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="Tensors travel packed into flat buckets of this many MiB, one broadcast "
        "each; a tensor of a sixteenth of that or more travels alone, straight from the "
        "trainer's memory. With gloo the trainer keeps the packed buffers for the next "
        "transfer (the size of its small tensors, at most).",
    )
    checkpoint_every: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="A checkpoint (for resuming; replicas do not read it) every this many "
        "published versions, and always at a clean stop; 1: every version.",
    )
    backend: Literal["gloo", "nccl"] = Field(
        default="gloo",
        description="gloo (CPU tensors; any replica) or nccl (a GPU trainer to replicas that "
        "say they take it, vLLM's GPU workers; the others, hf, get the same version over gloo). "
        "NCCL groups raise instead of hanging or ending the process (workers/weights/group.py).",
    )
