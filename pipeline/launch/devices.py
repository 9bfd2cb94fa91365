"""Which GPUs each process of a run owns: every process sees exactly its own, or none.

CUDA picks the devices a process may use from `CUDA_VISIBLE_DEVICES`; a process started
without it sees every GPU of its node, and torch's `cuda:0` is then somebody else's (a
replica's). So a launcher sets it on every process it starts, an empty value included:
`CUDA_VISIBLE_DEVICES=""` is how a process is told "no GPU": the trainer then trains on the
CPU (`trainer.device: auto`) or refuses in one line (`cuda`). On Ray the same holds: Ray sets
the variable only for actors granted an accelerator (since 2.x it leaves a zero-GPU actor's
environment alone), so the actor sets it for its child itself (`gpu_env`).

The local launcher (`LocalPipeline`) splits this machine's GPUs (`visible_gpus`; `--gpus N`
says how many, for a machine where they cannot be detected or a test) with `assign`: the
replicas first, packed by `ReplicaPlacementConfig.replica_gpus` (TP x DP x PP each), then the
trainer's ranks from what is left; every other process (sync controllers, the workers, the
judge's CPU replicas) gets none. What does not fit is refused in one line before anything
starts. On a machine without GPUs nothing is assigned (CPU replicas, a CPU build of vLLM).
Pure but for `visible_gpus`, which reads the environment and asks `nvidia-smi`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from pipeline.launch.placement import ReplicaPlacementConfig
from schemas.errors import RolloutError

__all__ = ["VISIBLE", "DeviceFitError", "assign", "gpu_env", "visible_gpus"]

VISIBLE = "CUDA_VISIBLE_DEVICES"


class DeviceFitError(RolloutError):
    """The run's processes do not fit this machine's (or node's) GPUs."""


def gpu_env(gpus: Sequence[str | int]) -> dict[str, str]:
    """The environment that gives a process exactly `gpus` (none: an empty value)."""
    return {VISIBLE: ",".join(str(g) for g in gpus)}


def visible_gpus(count: int | None = None) -> list[str]:
    """The GPU ids this process may hand out: `CUDA_VISIBLE_DEVICES` when set, else what
    `nvidia-smi` lists, else none. `count` (`rollout up --gpus N`) overrides the detection:
    the first N of those ids, or 0..N-1 where fewer are known."""
    found: list[str]
    declared = os.environ.get(VISIBLE)
    if declared is not None:
        found = [g.strip() for g in declared.split(",") if g.strip()]
    else:
        found = _nvidia_smi()
    if count is None:
        return found
    return found[:count] if len(found) >= count else [str(i) for i in range(count)]


def _nvidia_smi() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def assign(
    gpus: Sequence[str],
    *,
    backend: str,
    replicas: int,
    parallel: tuple[int, int, int] = (1, 1, 1),
    trainer_device: str | None = None,
    trainer_ranks: int = 1,
) -> dict[str, str]:
    """`CUDA_VISIBLE_DEVICES` of `replica-<i>` and `train` on a machine with `gpus`; any other
    process's is "" (none). `trainer_device` None: no trainer in the run.

    DeviceFitError when the replicas (world size TP x DP x PP each) do not fit the GPUs, or
    when the trainer must train on GPUs (`cuda`) and the replicas leave it too few."""
    gpus = list(gpus)
    owned: dict[str, str] = {}
    used = 0
    if backend != "hf" and replicas:
        tp, dp, pp = parallel
        world = tp * dp * pp
        # The replicas' share: whole replicas (the GPUs beyond a multiple go to the trainer).
        share = len(gpus) - len(gpus) % world if world <= len(gpus) else len(gpus)
        try:
            placement = ReplicaPlacementConfig(
                tensor_parallel_size=tp,
                data_parallel_size=dp,
                pipeline_parallel_size=pp,
                nnodes=1,
                gpus_per_node=share,
                num_replicas=replicas,
            )
        except ValueError as exc:
            raise DeviceFitError(
                f"{replicas} {backend} replicas do not fit this machine's {len(gpus)} GPUs: "
                f"{_first_line(exc)}"
            ) from None
        for i in range(replicas):
            owned[f"replica-{i}"] = ",".join(gpus[g] for _, g in placement.replica_gpus(i))
        used = replicas * placement.world_size
    else:
        owned.update({f"replica-{i}": "" for i in range(replicas)})
    if trainer_device is not None:
        owned["train"] = ",".join(_trainer_gpus(trainer_device, gpus[used:], trainer_ranks, used))
    return owned


def _trainer_gpus(device: str, free: list[str], ranks: int, taken: int) -> list[str]:
    """The trainer's GPUs (one per rank) from `free`: none on `cpu`; on `auto` none unless
    every rank has one; on `cuda` every rank must have one."""
    if device == "cpu" or (device == "auto" and len(free) < ranks):
        return []
    if device not in ("auto", "cuda", "cuda:0"):
        raise DeviceFitError(
            f"trainer.device={device}: the trainer sees only its own GPUs, from cuda:0; use "
            "trainer.device=cuda"
        )
    if len(free) < ranks:
        raise DeviceFitError(
            f"trainer.device={device} needs {ranks} GPU(s) and the replicas take {taken} of "
            f"{taken + len(free)}: fewer --replicas, or trainer.device=auto/cpu"
        )
    return free[:ranks]


def _first_line(exc: ValueError) -> str:
    """A pydantic validation error's own message, without its framing."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        found = errors()
        if found:
            return str(found[0].get("msg", exc)).removeprefix("Value error, ")
    return str(exc).splitlines()[0]
