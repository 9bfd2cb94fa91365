"""Launch the whole pipeline as Ray actors: `rollout up --ray [ADDRESS]`, `rollout down`.

The Ray launcher starts exactly the plan of the local one (`pipeline.launch.local.StagePlan`): one
detached, named actor per entry, in the fixed namespace `rollout-pipeline`, named
`<run>/<stage>` (`default/replica-0`, `default/train`, ...). Each actor supervises one child
process running the same `rollout` command a user would type, so the workers keep their own
main thread for SIGTERM handlers and asyncio, and a stop is the same SIGTERM as everywhere:

    up     write `<run_dir>/config.yaml` (secrets masked) → place the replica actors (GPUs
           sized TP x DP x PP for vllm, none for hf) → each picks a free port on its node →
           start the replicas (`--host 0.0.0.0 --advertise http://<node-ip>:<port>`), a sync
           controller pinned to each replica's node, then the agent-loop, reward, replay and
           train stages. With a judge pool (`reward.judge`), its replicas (`judge-<i>`, role
           judge, no sync) and the trainer share one bundle of the trainer's placement group
           (`pipeline.launch.ray.colocate`). Returns; the actors live on (detached).
    down   from any process: SIGTERM to every child (trainer first), a grace period, SIGKILL,
           then kill the actors (and remove the trainer's placement group, if any). A child
           also gets SIGTERM if its actor dies (PDEATHSIG).

Invariants: secrets reach the children only through the environment handed to each actor in
memory, never through a file; every process is started by one of the run's actors, so `down`
finds all of them by name, and each actor's stop also reaps the sessions begun under its
child (vLLM's: `pipeline.launch.reap`); each child sees only the GPUs Ray granted its actor
(`CUDA_VISIBLE_DEVICES`, empty for none); on more than one node every process gets
`ROLLOUT_SPANS_NODES=1` and refuses to announce a loopback address, and the trainer's
announced addresses (`trainer.lend.*`, a loopback `weights.host`) are set to its node's.
Multi-node runs need the run directory (config, logs) and the trainer's checkpoint directory
on storage every node mounts at the same path, and the Ray token (`~/.ray/auth_token`) on
each client. `ray` is imported only inside the functions here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import RunConfig
from pipeline.launch.local import StagePlan, judge_plan, secret_env
from pipeline.launch.ray import colocate
from pipeline.launch.ray.actor import StageRunner
from schemas.errors import RolloutError
from workers.ports import SPANS_NODES_ENV, is_loopback

__all__ = [
    "NAMESPACE",
    "LaunchError",
    "down",
    "get_within",
    "replica_world_size",
    "stage_resources",
    "up",
    "wait",
]

log = logging.getLogger("rollout.ray_launch")

NAMESPACE = "rollout-pipeline"


class LaunchError(RolloutError):
    """The pipeline could not be started or stopped on Ray."""


def stage_resources(
    name: str, *, backend: str, world_size: int, replica_threads: int, trainer_gpus: int = 0
) -> tuple[float, float]:
    """`(num_cpus, num_gpus)` one stage's actor asks Ray for.

    hf replicas use `replica_threads` CPUs and no GPU; other backends a GPU per rank of the
    replica (TP x DP x PP). The trainer asks one CPU and `trainer_gpus` GPUs (see
    `trainer_gpus`); the rest mostly wait on Kafka and the replicas, so they ask for none and
    never block scheduling.
    """
    if name.startswith("replica-"):
        return (float(replica_threads), 0.0) if backend == "hf" else (1.0, float(world_size))
    if name == "train":
        return 1.0, float(trainer_gpus)
    return 0.0, 0.0


def trainer_gpus(device: str, node_gpus: list[int], replica_gpus: int = 0) -> int:
    """GPUs the trainer's actor asks for, next to the `replica_gpus` the replicas take.

    `cpu`: none. `cuda`/`cuda:0`: one, which must be left free by the replicas (Ray makes
    the GPU it grants `cuda:0`, so `cuda:N` with N > 0 is refused). `auto`: one when the
    replicas leave one free, else none (the trainer then trains on the CPU).
    """
    free = sum(node_gpus) - replica_gpus
    if device == "cpu" or (device == "auto" and free < 1):
        return 0
    if device not in ("auto", "cuda", "cuda:0"):
        _bad(
            f"trainer.device={device}: under Ray the trainer gets one GPU, which it sees as "
            "cuda:0; use trainer.device=cuda"
        )
    if free < 1:
        _bad(
            f"trainer.device={device}, but the Ray cluster's {sum(node_gpus)} free GPUs are all "
            f"taken by the replicas ({replica_gpus})"
        )
    return 1


def _recorded_head() -> tuple[str | None, Path]:
    """The head address `ray start` recorded on this machine (Ray's "auto"), and where."""
    where = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"
    where = where / "ray_current_cluster"
    try:
        text = where.read_text().strip()
    except OSError:
        return None, where
    return (text or None), where


def _answers(address: str) -> bool:
    """Whether something accepts TCP connections at `host:port` (a live GCS does)."""
    from pipeline.broker.local import port_open

    host, _, port = address.rpartition(":")
    try:
        return port_open(host, int(port), timeout_s=2.0)
    except ValueError:  # not host:port
        return False


def connect(address: str | None, *, start_local: bool = False) -> None:
    """Join the cluster at `address`; without one, the local cluster (started if asked).

    A cluster started by `ray.init()` itself would die with this process and take the
    detached actors along, so a local one is started with `ray start --head` and outlives
    `rollout up` (stop it with `ray stop` when done).
    """
    import ray

    if ray.is_initialized():
        return
    opts: dict[str, Any] = {
        "namespace": NAMESPACE,
        "log_to_driver": False,
        "logging_level": logging.WARNING,
    }
    if address:
        ray.init(address=address, **opts)
        return
    recorded, where = _recorded_head()
    if recorded is not None and not os.environ.get("RAY_ADDRESS") and not _answers(recorded):
        # Ray itself would retry a dead recorded head for minutes before it gives up.
        if not start_local:
            raise LaunchError(
                f"no Ray cluster answers at {recorded} (recorded in {where} by an earlier "
                "`ray start`); pass the address of a running one"
            )
    else:
        try:
            ray.init(address="auto", **opts)
            return
        except ConnectionError:
            if not start_local:
                raise LaunchError("no Ray cluster runs here; pass its address") from None
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--disable-usage-stats",
        "--include-dashboard=false",
    ]
    print("starting a local Ray head (stop it with `ray stop`)", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LaunchError(f"ray start --head failed:\n{done.stderr[-2000:]}")
    ray.init(address="auto", **opts)


def _actors(run: str | None) -> dict[str, Any]:
    import ray

    names = sorted(
        n for n in ray.util.list_named_actors() if run is None or n.startswith(run + "/")
    )
    found = {}
    for name in names:
        try:
            found[name] = ray.get_actor(name)
        except ValueError:  # died between listing and lookup
            continue
    return found


def replica_world_size(
    backend: str, parallel: tuple[int, int, int], replicas: int, node_gpus: list[int]
) -> int:
    """GPUs of one replica (TP x DP x PP; 1 process for hf), checked against the cluster.

    `node_gpus` are the GPU counts of the cluster's nodes. hf replicas run on CPU; a GPU
    backend needs `replicas` x world size GPUs, each replica inside one node (one actor).
    """
    if backend == "hf":
        if parallel != (1, 1, 1):
            _bad("the hf backend runs on CPU: it takes no --tp/--dp/--pp")
        return 1
    gpus = [g for g in node_gpus if g > 0]
    if not gpus:
        _bad(f"backend {backend} needs GPUs and the Ray cluster has none")
    tp, dp, pp = parallel
    world = tp * dp * pp
    if world > max(gpus):
        _bad(
            f"a replica of {world} GPUs (TP x DP x PP) would be spanning nodes (the largest "
            f"has {max(gpus)}): not supported by the Ray launcher yet"
        )
    # Each node holds its own whole replicas: nodes of 8 and 2 GPUs hold two of 4, not four.
    fits = sum(g // world for g in gpus)
    if replicas > fits:
        _bad(
            f"replicas do not fit the cluster: {replicas} of {world} GPUs each (TP x DP x PP), "
            f"and its nodes of {', '.join(map(str, gpus))} GPUs hold {fits} (a replica runs "
            "within one node)"
        )
    return world


def _trainer_address_args(cfg: RunConfig, train: Any, timeout_s: float) -> list[str]:
    """What the trainer announces, at its node's address (reachable from the other nodes):
    the lent trainer's replica (`trainer.lend`) listens on every interface of the node, at a
    port free there; the broadcast rendezvous (`weights.host`, when loopback) at the node's
    address."""
    lend = cfg.trainer.lend.enable
    broadcast = cfg.weights.mode == "broadcast" and is_loopback(cfg.weights.host)
    if not lend and not broadcast:
        return []
    place = get_within([train.where.remote()], timeout_s, "placing the trainer")[0]
    args = ["--set", f"weights.host={place['ip']}"] if broadcast else []
    if lend:
        args += [
            *("--set", "trainer.lend.host=0.0.0.0"),
            *("--set", f"trainer.lend.port={place['port']}"),
            *("--set", f"trainer.lend.advertise=http://{place['ip']}:{place['port']}"),
        ]
    return args


def _bad(message: str) -> None:
    raise LaunchError(message)


def up(
    cfg: RunConfig,
    *,
    address: str | None,
    run_dir: str | Path,
    run: str = "default",
    replicas: int = 2,
    parallel: tuple[int, int, int] = (1, 1, 1),
    start_timeout_s: float = 600.0,
    extra_env: dict[str, str] | None = None,
    **plan: Any,
) -> list[dict[str, Any]]:
    """Start every stage of one run as detached actors; one description per actor.

    `plan`: the fields of `StagePlan` (`model_dir`, `backend`, `replica_threads`, ...; the
    judge's pool from `cfg` unless `plan` says otherwise); a GPU backend's replicas also get
    `--tp/--dp/--pp` of `parallel`."""
    import ray

    layout = StagePlan(**{**judge_plan(cfg), **plan})
    backend, stages, replica_threads = layout.backend, layout.stages, layout.replica_threads
    judges = layout.judge_replicas
    connect(address, start_local=True)
    if _actors(run):
        raise LaunchError(f"run {run!r} is already up; `rollout down --run {run}` first")
    node_gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    world_size = replica_world_size(backend, parallel, replicas, node_gpus)
    replica_gpus = 0 if backend == "hf" else replicas * world_size
    # trainer.nproc > 1: the train actor is the driver of one actor per rank
    # (`pipeline.launch.ray.trainer`), which ask for the GPUs and CPUs themselves
    ranks = cfg.trainer.nproc if "train" in stages and cfg.trainer.nproc > 1 else 0
    # the trainer's GPU comes from the free ones (another run's actors may hold some)
    free_gpus = int(ray.available_resources().get("GPU", 0))
    train_gpus = (
        trainer_gpus(cfg.trainer.device, [free_gpus], replica_gpus)
        if "train" in stages and not ranks
        else 0
    )
    if backend != "hf":
        layout = replace(layout, parallel=parallel)

    def resources(name: str) -> tuple[float, float]:
        if name == "train" and ranks:
            return 0.0, 0.0
        if name.startswith("judge-"):  # hf, in the trainer's bundle
            return float(layout.judge_threads), 0.0
        return stage_resources(
            name,
            backend=backend,
            world_size=world_size,
            replica_threads=replica_threads,
            trainer_gpus=train_gpus,
        )

    zeros = layout.processes([0] * replicas, judge_ports=[0] * judges)
    needed = sum(resources(name)[0] for name, _ in zeros) + ranks
    have = ray.cluster_resources().get("CPU", 0.0)
    if needed > have:
        _bad(
            f"the run asks for {needed:g} CPUs and the Ray cluster has {have:g}: "
            "fewer --replicas or --replica-threads, or a bigger cluster"
        )
    run_dir = Path(run_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.redacted(), sort_keys=False))
    env = {**secret_env(cfg), **(extra_env or {})}
    if len(node_gpus) > 1:  # every process refuses to announce a loopback address
        env[SPANS_NODES_ENV] = "1"
    runner = ray.remote(StageRunner)

    # The judge's replicas are colocated: one bundle with the trainer (`colocate`).
    group = None
    shared: dict[str, Any] = {}

    def actor(name: str, **options: Any) -> Any:
        if name == "train" or name.startswith("judge-"):
            options = {**shared, **options}
        cpus, gpus = resources(name)
        return runner.options(
            name=f"{run}/{name}",
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=0,
            num_cpus=cpus,
            num_gpus=gpus,
            **options,
        ).remote(name, str(run_dir / "logs" / f"{name}.log"))

    started: dict[str, Any] = {}
    try:
        if judges:
            cpus = sum(resources(n)[0] for n, _ in zeros if n == "train" or n.startswith("judge-"))
            group = colocate.reserve(run, cpus, resources("train")[1] if "train" in stages else 0)
            get_within([group.ready()], start_timeout_s, "reserving the trainer's bundle")
            shared = colocate.bundle_options(group)
        # Replicas first: each picks its port on the node Ray placed it on.
        servers = [f"replica-{i}" for i in range(replicas)] + [f"judge-{i}" for i in range(judges)]
        for name in servers:
            started[name] = actor(name)
        placed = get_within(
            [started[name].where.remote() for name in servers],
            start_timeout_s,
            "placing the replicas",
        )
        places = dict(zip(servers, placed, strict=True))
        pending, addresses = [], {}
        for name, argv in layout.processes(
            [places[f"replica-{i}"]["port"] for i in range(replicas)],
            judge_ports=[places[f"judge-{i}"]["port"] for i in range(judges)],
        ):
            kind, _, index = name.partition("-")
            if kind in ("replica", "judge"):
                place = places[name]
                addresses[name] = f"http://{place['ip']}:{place['port']}"
                argv = [*argv, "--host", "0.0.0.0", "--advertise", addresses[name]]
            elif kind == "sync":
                # The controller reaches its replica on loopback: keep them on one node.
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                node = NodeAffinitySchedulingStrategy(
                    places[f"replica-{index}"]["node_id"], soft=False
                )
                started[name] = actor(name, scheduling_strategy=node)
            else:
                if kind == "train" and ranks:
                    argv = [*argv, "--ray", ray.get_runtime_context().gcs_address]
                started[name] = actor(name)
                if kind == "train":  # its lent replica, its broadcast rendezvous
                    argv = [*argv, *_trainer_address_args(cfg, started[name], start_timeout_s)]
            pending.append(started[name].start.remote(["--config", str(config_path), *argv], env))
        described = get_within(pending, start_timeout_s, "starting the stages")
    except BaseException:
        _stop(started, grace_s=10.0)
        if group is not None:
            colocate.remove_groups(run)
        raise
    for row in described:
        row["actor"] = f"{run}/{row['stage']}"
        if row["stage"] in addresses:
            row["address"] = addresses[row["stage"]]
    return list(described)


def get_within(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    """`ray.get(refs)`, or a LaunchError naming `what` when it takes over `timeout_s`."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return list(ray.get(refs, timeout=timeout_s))
    except GetTimeoutError as exc:
        raise LaunchError(
            f"{what} took over {timeout_s:.0f}s: the cluster lacks the CPUs/GPUs asked for?"
        ) from exc


def wait(
    address: str | None,
    *,
    run: str = "default",
    stage: str = "train",
    timeout_s: float | None = None,
    poll_s: float = 2.0,
) -> int:
    """Block until `stage` of the run exits; its exit status. LaunchError if another died."""
    import ray
    from ray.exceptions import RayActorError

    connect(address)
    actors = _actors(run)
    target = actors.get(f"{run}/{stage}")
    if target is None:
        raise LaunchError(f"run {run!r} has no stage {stage!r}")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        try:
            polled = ray.get([a.poll.remote() for a in actors.values()])
        except RayActorError as exc:
            raise LaunchError(f"an actor of run {run!r} died: {exc}") from exc
        codes = dict(zip(actors, polled, strict=True))
        if codes[f"{run}/{stage}"] is not None:
            return int(codes[f"{run}/{stage}"])
        dead = [name for name, code in codes.items() if code is not None]
        if dead:
            tail = ray.get(actors[dead[0]].tail.remote())
            raise LaunchError(f"{dead[0]} exited with {codes[dead[0]]}:\n{tail}")
        time.sleep(poll_s)
    raise LaunchError(f"{run}/{stage} still runs after {timeout_s:.0f}s")


def down(address: str | None, *, run: str | None = None, grace_s: float = 20.0) -> dict[str, Any]:
    """Stop every stage (of `run`, or of all runs) and kill their actors; exit statuses."""
    connect(address)
    codes = _stop(_actors(run), grace_s=grace_s)
    colocate.remove_groups(run)
    return codes


def _stop(actors: dict[str, Any], *, grace_s: float) -> dict[str, Any]:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    # The trainer and the workers first, the replicas last, as the local launcher does.
    order = sorted(
        actors, key=lambda n: n.split("/")[-1].startswith(("replica-", "sync-", "judge-"))
    )
    for name in order:
        actors[name].terminate.remote()
    codes: dict[str, Any] = {}
    refs = {name: actors[name].stop.remote(grace_s) for name in order}
    for name, ref in refs.items():
        try:
            codes[name] = ray.get(ref, timeout=grace_s + 30)
        except (RayActorError, GetTimeoutError) as exc:
            codes[name] = f"unknown ({type(exc).__name__})"
        ray.kill(actors[name], no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(n in codes for n in ray.util.list_named_actors()):
        time.sleep(0.2)
    return codes
