"""`rollout train --nproc N --ray [ADDRESS]`: the sharded trainer as N Ray actors, one per rank.

What torchrun does on one node, done by Ray on a cluster: this process (the driver) reserves
one placement group of N bundles (one GPU each when the trainer trains on GPUs and N are free,
else one CPU each; PACK: all or nothing, on as few nodes as hold them), starts one actor in
each bundle (`place_ranks`), learns where each landed (`StageRunner.where`), and starts in
every actor the same `rollout` command it was given, in the same working directory (relative
paths keep their meaning), with the variables torchrun would set:

    RANK, WORLD_SIZE          actor i is rank i of N
    LOCAL_RANK                its index among the ranks on its node (rank order), with
    LOCAL_WORLD_SIZE          how many ranks share that node
    MASTER_ADDR, MASTER_PORT  rank 0's node and a port free there (the rendezvous)
    CUDA_VISIBLE_DEVICES      GPU ranks: the GPUs Ray granted the node's ranks, in local-rank
                              order, so `cuda:LOCAL_RANK` is the rank's own GPU and NCCL sees
                              its peers (as Ray Train does); CPU ranks: empty, none

`WORLD_SIZE` makes each child take the rank path (`workers.trainer.sharded`): rank 0 is the
trainer that reads Kafka, commits offsets with its checkpoints and publishes on `rl.policy`;
the others follow it. Nothing else differs from torchrun: the accounting, the checkpoints and a
restart are the sharded trainer's.

Lifecycle, torchrun's: the actors belong to this driver's Ray job (not detached), so they and
their children (PDEATHSIG) end with it. SIGTERM/SIGINT are passed to every rank (rank 0 then
checkpoints and stops the others); a rank that fails stops the rest (SIGTERM, a grace period,
SIGKILL) and the exit status is the first failure's, else 0. Rank 0's result line (JSON) is
printed here. Each rank logs to `<checkpoint_dir>/logs/train-rank-<i>.log` on its node; on more
than one node the config files and `trainer.checkpoint_dir` must be on storage every node
mounts at the same path. Secrets reach the ranks by environment, never by file. `ray` is
imported only inside the functions here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.launch.devices import gpu_env
from pipeline.launch.local import secret_env
from pipeline.launch.ray.actor import StageRunner
from pipeline.launch.ray.stages import NAMESPACE, LaunchError, connect, get_within
from workers.trainer.config import TrainerConfig

__all__ = ["place_ranks", "rank_env", "rank_gpus", "train_on_ray"]

log = logging.getLogger("rollout.ray_train")


def rank_gpus(device: str, nproc: int, cluster_gpus: int) -> int:
    """GPUs each rank's actor asks for: 1 when the trainer trains on GPUs, else 0.

    `cluster_gpus`: the GPUs free on the cluster now. `cpu`: 0. `auto`: 1 when a GPU is free
    for every rank, else 0 (gloo on CPUs, each rank seeing none). `cuda`/`cuda:0`: 1, and
    `nproc` must be free."""
    if device == "cpu" or (device == "auto" and cluster_gpus < nproc):
        return 0
    if device not in ("auto", "cuda", "cuda:0"):
        raise LaunchError(
            f"trainer.device={device}: under Ray each rank gets one GPU, which it "
            "sees as its own; use trainer.device=cuda"
        )
    if cluster_gpus < nproc:
        raise LaunchError(
            f"{nproc} GPU ranks asked for and the Ray cluster has {cluster_gpus} free "
            "GPUs: fewer --nproc, or trainer.device=cpu"
        )
    return 1


def rank_env(places: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The torchrun variables of each rank (the module docstring), from where its actor is.

    `places[i]` is rank i's `StageRunner.where()`: `node_id`, `ip`, `port`, `gpus`."""
    world = len(places)
    on_node: dict[str, list[int]] = {}
    for rank, place in enumerate(places):
        on_node.setdefault(place["node_id"], []).append(rank)
    master = places[0]
    envs = []
    for rank, place in enumerate(places):
        peers = on_node[place["node_id"]]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(peers.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            "MASTER_ADDR": str(master["ip"]),
            "MASTER_PORT": str(master["port"]),
        }
        # CPU ranks see none (Ray sets nothing for an actor without GPUs: all would show)
        gpus = [places[p]["gpus"][0] for p in peers] if place["gpus"] else []
        envs.append(env | gpu_env(gpus))
    return envs


def train_on_ray(
    cfg: RunConfig,
    trainer: TrainerConfig,
    cli_argv: list[str],
    *,
    address: str | None,
    start_timeout_s: float = 600.0,
    grace_s: float = 30.0,
) -> int:
    """Run `rollout <cli_argv>` as `trainer.nproc` rank actors until they finish; exit status."""
    try:
        import ray
    except ImportError:
        raise LaunchError("--ray needs Ray: pip install 'rollout-pipeline[ray]'") from None
    connect(address)
    nproc = trainer.nproc
    # sized from the GPUs free now (another run's actors may hold some), not the cluster's
    gpus = rank_gpus(trainer.device, nproc, int(ray.available_resources().get("GPU", 0)))
    logs = Path(trainer.checkpoint_dir).resolve() / "logs"
    group, actors, places = None, [], []
    # what configures `rollout` besides the files (ROLLOUT_*), and the secrets
    passed = {k: v for k, v in os.environ.items() if k.startswith("ROLLOUT_")} | secret_env(cfg)
    stopping: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, _: stopping.append(signum))
        for s in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        group, actors, places = place_ranks(nproc, gpus, logs, start_timeout_s)
        envs = rank_env(places)
        starts = [
            a.start.remote(cli_argv, passed | env, os.getcwd())
            for a, env in zip(actors, envs, strict=True)
        ]
        get_within(starts, start_timeout_s, "starting the ranks")
        log.info("%d trainer ranks on Ray: %s", nproc, [p["ip"] for p in places])
        code = _wait(actors, stopping, grace_s)
        tail = str(ray.get(actors[0].tail.remote(4000)))
        lines = [line for line in tail.splitlines() if line.startswith("{")]
        if code == 0 and lines:
            print(lines[-1], flush=True)
        elif code != 0:
            print(f"rank logs in {logs}; rank 0's ends:\n{tail[-1500:]}", file=sys.stderr)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)


def place_ranks(
    nproc: int, gpus: int, logs: Path, timeout_s: float
) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    """Reserve the ranks as one placement group (a bundle of 1 CPU and `gpus` GPUs a rank,
    PACK: all or nothing, on as few nodes as hold them, so FSDP's ranks do not scatter) and
    start one actor in each bundle; the group, the actors and their `where()`, in rank order
    (the ranks of one node consecutive, rank 0's node first). Nothing starts unless the whole
    group fits: LaunchError after `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}
    group = placement_group([dict(bundle) for _ in range(nproc)], strategy="PACK")
    try:
        get_within([group.ready()], timeout_s, f"reserving {nproc} trainer ranks ({bundle} each)")
        runner = ray.remote(StageRunner)
        actors = [
            runner.options(
                namespace=NAMESPACE,
                max_restarts=0,
                num_cpus=1,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=i
                ),
            ).remote(f"train-rank-{i}", str(logs / f"train-rank-{i}.log"))
            for i in range(nproc)
        ]
        places = get_within([a.where.remote() for a in actors], timeout_s, "placing the ranks")
    except BaseException:
        remove_placement_group(group)
        raise
    first = {node: i for i, node in reversed(list(enumerate(p["node_id"] for p in places)))}
    order = sorted(range(nproc), key=lambda i: (first[places[i]["node_id"]], i))
    return group, [actors[i] for i in order], [places[i] for i in order]


def _wait(actors: list[Any], stopping: list[int], grace_s: float) -> int:
    """Poll the ranks until all exited; pass on a stop; a failure stops the rest."""
    import ray

    signalled = 0
    while True:
        if len(stopping) > signalled:
            signalled = len(stopping)
            ray.get([a.terminate.remote() for a in actors])
        codes = ray.get([a.poll.remote() for a in actors])
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            log.error("a trainer rank exited with %s; stopping the others", failed[0])
            ray.get([a.stop.remote(grace_s) for a in actors])
            return int(failed[0])
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.5)
