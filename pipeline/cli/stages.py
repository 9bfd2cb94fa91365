"""The long-running processes' commands: `rollout replica serve|sync`, `rollout worker
agent-loop|reward|replay`, `rollout train`. Each parses its config first and imports its
stage (and torch) only when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeline.cli.common import at_least, checked_model_dir, port, print_json
from pipeline.config import ConfigError, RunConfig

__all__ = ["add_parsers", "advertised_address"]


def cmd_replica_serve(args: argparse.Namespace, cfg: RunConfig) -> int:
    import socket

    from schemas.events import ReplicaInfo
    from workers.llm.engines import get_backend
    from workers.llm.engines.registration import ReplicaRegistration

    # Everything a user can get wrong is checked before the backend (torch, vLLM) imports.
    if args.backend == "hf" or Path(args.model).expanduser().exists():
        # vLLM also takes a hub id, which is not a path here.
        args.model = checked_model_dir(args.model, "--model")
    _require_free_port(args.host, args.port)
    if args.routed_experts:
        _require_routing(args.backend, args.model)
    advertised = advertised_address(args)
    if args.register:
        _require_topic(cfg, "replicas", "to register on")
    engine_python = args.sglang_python if args.backend == "sglang" else None
    backend = get_backend(args.backend, python=engine_python)
    replica_id = args.replica_id or f"{args.backend}-{socket.gethostname()}-{args.port}"
    registration = None
    if args.register:
        info = ReplicaInfo(
            replica_id=replica_id,
            address=advertised,
            backend=args.backend,
            model=args.model,
            version=args.version,
            role=args.role,
        )
        registration = ReplicaRegistration(cfg.kafka, cfg.topics.name("replicas"), info)
        registration.start()
    try:
        result = backend.serve(
            args.model,
            args.host,
            args.port,
            replica_id,
            args.version,
            **_backend_options(args, cfg),
        )
    finally:
        if registration is not None:
            registration.leave()
    return int(result or 0)


def advertised_address(args: argparse.Namespace) -> str:
    """The address a replica announces: `--advertise`, else http://HOST:PORT, where a replica
    listening on every interface (0.0.0.0) names the node's routable address. A loopback
    one is refused (one line) when it registers in a run that spans nodes."""
    from workers.ports import check_reachable, routable_ip

    host = routable_ip() if args.host in ("0.0.0.0", "::") else args.host
    advertised = str(args.advertise or f"http://{host}:{args.port}")
    if args.register:
        check_reachable(advertised, "--advertise" if args.advertise else "the replica's address")
    return advertised


def _backend_options(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    """The backend's own `serve` options from `replica serve`'s flags (each backend's only)."""
    common = {"max_model_len": args.max_model_len, "served_model_name": args.served_model_name}
    # broadcast weights (hf, vllm): a replica serves nothing until it holds the trainer's (a
    # judge serves its own model and never gets them)
    awaits = cfg.weights.mode == "broadcast" and args.role == "policy"
    if args.backend == "hf":
        if args.dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"--dtype {args.dtype}: the hf replica serves float32 or bfloat16")
        return common | {
            "await_weights": awaits,
            "threads": args.threads,
            "max_batch": args.max_batch,
            "prefix_cache_tokens": args.prefix_cache_tokens,
            "role": args.role,  # the hf engine says it, and refuses weights as a judge
            "dtype": args.dtype or "float32",  # it serves fp32 unless told
        }
    if args.backend == "sglang":
        return common | {
            "tp": args.tp,
            "dp": args.dp,
            "pp": args.pp,
            **_serving_dtype(args.dtype, cfg.trainer.precision),
            "internal_port": args.internal_port,
            "extra_args": tuple(args.sglang_arg),
            "python": args.sglang_python,
        }
    return common | {
        "await_weights": awaits,
        "tp": args.tp,
        "dp": args.dp,
        "pp": args.pp,
        **_serving_dtype(args.dtype, cfg.trainer.precision),
        "internal_port": args.internal_port,
        "extra_args": tuple(args.vllm_arg),
        "python": args.vllm_python or cfg.vllm.python,
        "return_routed_experts": args.routed_experts,
    }


#: trainer.precision → the vLLM dtype whose logprobs the trainer recomputes.
_DTYPE_OF_PRECISION = {"fp32": "float32", "bf16": "bfloat16"}


def _serving_dtype(given: str | None, precision: str) -> dict[str, str]:
    """`--dtype`, else the trainer's precision, and why (the replica says it once vLLM's
    interpreter has been found)."""
    dtype = given or _DTYPE_OF_PRECISION[precision]
    why = "--dtype" if given else f"trainer.precision={precision}; --dtype to change"
    return {"dtype": dtype, "dtype_reason": why}


def _require_routing(backend: str, model: str) -> None:
    """ConfigError unless `--routed-experts` can mean something here."""
    from workers.llm.moe import is_moe

    if backend != "vllm":
        raise ConfigError(
            f"--routed-experts is a vllm option, not {backend}'s (the hf engine returns a MoE "
            "model's routing to every request that asks)"
        )
    if Path(model).expanduser().exists() and not is_moe(model):
        raise ConfigError(f"--routed-experts: {model} is no Mixture-of-Experts model")


def _require_free_port(host: str, port: int) -> None:
    """ConfigError if nothing can listen on host:port (in use, or no such address). A probe:
    the port is free again at once, for the backend to bind; losing that race is rare."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise ConfigError(
            f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc


def _require_topic(cfg: RunConfig, role: str, why: str) -> None:
    from workers.kafka.admin import missing_topics
    from workers.kafka.exceptions import MissingTopicsError

    if missing := missing_topics(cfg.kafka, [cfg.topics.name(role)]):
        raise MissingTopicsError(
            f"no topic {missing[0]} {why} (run `rollout topics create`)", topics=missing
        )


def cmd_worker_agent_loop(args: argparse.Namespace, cfg: RunConfig) -> int:
    # A SIGTERM that arrives while the worker is still importing or connecting is a request
    # to stop, honoured gracefully once it runs (exit 0), not a crash.
    early_stop = _stop_event_on_signals()
    from workers.agent_loop.main import run

    worker_cfg = cfg.agent_loop
    if args.model:
        worker_cfg = worker_cfg.model_copy(update={"model": args.model})
    if args.replica:
        worker_cfg = worker_cfg.model_copy(update={"replicas": args.replica})
    if not worker_cfg.model:
        raise ConfigError("agent_loop.model (or --model) must name the model directory")
    checked_model_dir(worker_cfg.model, "--model" if args.model else "agent_loop.model")
    metrics = _metrics("agent-loop", args)
    return run(cfg.kafka, cfg.topics, worker_cfg, metrics=metrics, early_stop=early_stop)


def _metrics(stage: str, args: argparse.Namespace) -> Any:
    """The process's `StageMetrics`, served on `--metrics-port` (0 or absent: not served)."""
    from workers.metrics import StageMetrics, TrainerMetrics

    metrics = TrainerMetrics() if stage == "train" else StageMetrics(stage)  # type: ignore[arg-type]
    metrics.serve(args.metrics_port)
    return metrics


def _stop_event_on_signals(*, graceful: bool = True) -> Any:
    """SIGTERM and SIGINT set the returned event; with `graceful=False`, SIGINT interrupts at
    once until the stage calls `.graceful()` (`workers.stopping.StopSignal`)."""
    from workers.stopping import StopSignal

    return StopSignal(graceful=graceful).install()


def cmd_worker_reward(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.reward.main import run_worker

    if args.tokenizer:
        cfg = cfg.model_copy(
            update={"reward": cfg.reward.model_copy(update={"tokenizer": args.tokenizer})}
        )
    if cfg.reward.tokenizer:
        flag = "--tokenizer" if args.tokenizer else "reward.tokenizer"
        checked_model_dir(cfg.reward.tokenizer, flag)
    if cfg.reward.judge.enable and cfg.reward.judge.model:
        checked_model_dir(cfg.reward.judge.model, "reward.judge.model")

    return int(run_worker(cfg.kafka, cfg.topics, cfg.reward, metrics=_metrics("reward", args)) or 0)


def cmd_worker_replay(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.replay.main import run_worker

    return int(run_worker(cfg.kafka, cfg.topics, cfg.replay, metrics=_metrics("replay", args)) or 0)


def cmd_train(args: argparse.Namespace, cfg: RunConfig) -> int:
    from dataclasses import asdict

    from pipeline.launch.torchrun import launched_by_torchrun

    trainer_cfg = cfg.trainer
    if args.model:
        trainer_cfg = trainer_cfg.model_copy(update={"model_dir": args.model})
    if args.nproc:
        trainer_cfg = trainer_cfg.model_copy(update={"nproc": args.nproc})
    if args.ray is not None and not launched_by_torchrun():  # the driver of N rank actors
        import sys

        from pipeline.launch.ray.trainer import train_on_ray

        return train_on_ray(cfg, trainer_cfg, sys.argv[1:], address=args.ray or None)
    if trainer_cfg.nproc > 1 or launched_by_torchrun():
        return _train_sharded(args, cfg, trainer_cfg)
    stop = _stop_event_on_signals(graceful=False)  # before torch imports (workers.trainer.main)
    from workers.trainer.main import run

    result = run(
        cfg.kafka, cfg.topics, trainer_cfg, weights=cfg.weights, metrics=_metrics("train", args),
        stop=stop,
    )  # fmt: skip
    print_json(asdict(result))
    return 0


def _train_sharded(args: argparse.Namespace, cfg: RunConfig, trainer_cfg: Any) -> int:
    """`rollout train` as N torchrun ranks: relaunch this very command under torchrun, then in
    each rank run `workers.trainer.sharded` (metrics served and the result printed by rank 0)."""
    import os
    import sys
    from dataclasses import asdict

    from pipeline.launch.torchrun import launched_by_torchrun, relaunch

    if not launched_by_torchrun():
        return relaunch(trainer_cfg.nproc, "pipeline.cli.main", sys.argv[1:])
    from workers.trainer.sharded import leave_rank, run_sharded_trainer

    rank0 = os.environ.get("RANK", "0") == "0"
    stop = _stop_event_on_signals()
    metrics = _metrics("train", args) if rank0 else None
    result = run_sharded_trainer(cfg.kafka, cfg.topics, trainer_cfg, stop, metrics=metrics)
    if result is not None:
        print_json(asdict(result))
    leave_rank(0)


def cmd_replica_sync(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.weights.sync import quiet_store_warnings, run_controller

    quiet_store_warnings()
    stop, metrics = _stop_event_on_signals(), _metrics("sync", args)
    run_controller(cfg.kafka, cfg.topics, args.replica, stop, metrics=metrics)
    return 0


def _add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="Serve Prometheus metrics at http://0.0.0.0:PORT/metrics (0: off).",
    )


def add_parsers(sub: Any) -> None:
    from workers.llm.engines import backend_names  # names only: imports no backend

    replica = sub.add_parser("replica", help="Inference replicas.")
    rsub = replica.add_subparsers(dest="action", required=True)
    serve = rsub.add_parser("serve", help="Serve the replica contract over HTTP.")
    serve.add_argument(
        "--backend",
        default="hf",
        choices=backend_names(),
        help="hf (CPU), vllm (GPUs) or sglang (GPUs; only where --sglang-python finds the "
        "sglang package: README, SGLang).",
    )
    serve.add_argument("--model", required=True, help="Model directory.")
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=port, default=8000, help="Port to listen on.")
    serve.add_argument(
        "--replica-id",
        help="Its id on rl.replicas (default: BACKEND-HOSTNAME-PORT, stable across restarts).",
    )
    serve.add_argument(
        "--version", type=int, default=0, help="Policy version of the weights at start."
    )
    serve.add_argument(
        "--served-model-name", help="Model name it answers to (default: from --model)."
    )
    serve.add_argument("--max-model-len", type=at_least(16, int), help="Context length cap.")
    serve.add_argument("--threads", type=int, default=2, help="torch threads (hf).")
    serve.add_argument(
        "--max-batch",
        type=at_least(1, int),
        default=64,
        help="Sequences it runs at once; more wait (hf).",
    )
    serve.add_argument(
        "--prefix-cache-tokens",
        type=at_least(0, int),
        default=32768,
        help="Tokens of finished sequences' KV kept for reuse (hf).",
    )
    serve.add_argument("--register", action="store_true", help="Announce on the replicas topic.")
    serve.add_argument(
        "--role",
        choices=["policy", "judge"],
        default="policy",
        help="judge: serves another model for reward.judge; the agent loops never route to "
        "it and no weight update reaches it (default: policy).",
    )
    serve.add_argument(
        "--advertise",
        help="Address others reach it at (default http://HOST:PORT; with --host 0.0.0.0 the "
        "node's routable address). A loopback one is refused in a run that spans nodes.",
    )
    for flag, what in (("--tp", "Tensor"), ("--dp", "Data"), ("--pp", "Pipeline")):
        serve.add_argument(flag, type=int, default=1, help=f"{what}-parallel size (vllm).")
    serve.add_argument(
        "--vllm-python",
        metavar="PY",
        help="Interpreter with vLLM (vllm.python; default .venv-vllm/bin/python if present).",
    )
    serve.add_argument(
        "--dtype",
        help="Weights dtype, e.g. bfloat16 (vllm, sglang; hf: float32 or bfloat16, default "
        "float32; default: the trainer's precision, so the replica's logprobs are the trainer's).",
    )
    serve.add_argument(
        "--internal-port", type=port, help="vLLM's own loopback port (vllm; default: a free one)."
    )
    serve.add_argument(
        "--routed-experts",
        action="store_true",
        help="Return routed experts (vllm: a MoE model; needs vLLM's model runner V2, which "
        "the CPU build lacks; the hf engine always can).",
    )
    serve.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="One more `vllm serve` argument, verbatim (repeat; --vllm-arg=-O0).",
    )
    serve.add_argument(
        "--sglang-python",
        metavar="PY",
        help="Interpreter with SGLang (sglang; default .venv-sglang/bin/python if present).",
    )
    serve.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="One more SGLang server argument, verbatim (repeat; --sglang-arg=--log-level=debug).",
    )
    serve.set_defaults(handler=cmd_replica_serve)

    sync = rsub.add_parser("sync", help="Load each new policy version into a replica.")
    sync.add_argument("--replica", required=True, help="The replica's URL.")
    _add_metrics_port(sync)
    sync.set_defaults(handler=cmd_replica_sync)

    train = sub.add_parser("train", help="The off-policy trainer on the replay topic.")
    train.add_argument("--model", help="Model directory (trainer.model_dir).")
    train.add_argument(
        "--nproc",
        type=int,
        default=0,
        metavar="N",
        help="Ranks on this node, FSDP2-sharded via torchrun (trainer.nproc; 1: one process).",
    )
    train.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="Run the --nproc ranks as Ray actors, one each (a GPU each on cuda), on the "
        "cluster at ADDRESS (none: the local one).",
    )
    _add_metrics_port(train)
    train.set_defaults(handler=cmd_train)

    worker = sub.add_parser("worker", help="Pipeline stages.")
    wsub = worker.add_subparsers(dest="stage", required=True)
    agent = wsub.add_parser("agent-loop", help="rl.prompts → agent loops → rl.turns.")
    agent.add_argument("--model", help="Model directory for the tokenizer (agent_loop.model).")
    _add_metrics_port(agent)
    agent.add_argument(
        "--replica", action="append", help="Replica URL (repeat); default: discover."
    )
    agent.set_defaults(handler=cmd_worker_agent_loop)
    reward = wsub.add_parser("reward", help="rl.turns → trajectories → scores → rl.scored.")
    reward.add_argument(
        "--tokenizer",
        "--model",
        dest="tokenizer",
        help="Tokenizer (or model) directory that decodes responses (reward.tokenizer).",
    )
    _add_metrics_port(reward)
    reward.set_defaults(handler=cmd_worker_reward)
    replay = wsub.add_parser(
        "replay", help="rl.scored → groups, staleness, advantages → rl.replay."
    )
    _add_metrics_port(replay)
    replay.set_defaults(handler=cmd_worker_replay)
