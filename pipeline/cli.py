"""`rollout`: the command line of the pipeline.

Parses the config first and imports heavy modules (kafka clients, torch) only inside the
command that needs them, so `rollout --help` is instant and a test checks that importing
this module pulls in neither torch nor vllm.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.cli import add_bench_parsers
from pipeline.chaos.__main__ import add_arguments as add_chaos_arguments
from pipeline.config import ConfigError, RunConfig, load_config, parse_overrides
from pipeline.load.cli import add_load_parser
from schemas.errors import RolloutError

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace, RunConfig], int]


def _config(args: argparse.Namespace) -> RunConfig:
    overrides = parse_overrides(args.set or [])
    if args.bootstrap:
        overrides.setdefault("kafka", {})["bootstrap_servers"] = args.bootstrap
    return load_config(args.config, overrides)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data) + "\n")


# --- kafka ---------------------------------------------------------------------------


def cmd_kafka_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.kafka_local import start_broker

    port = args.port or cfg.local_kafka.port
    state = start_broker(
        port,
        args.data_dir or cfg.local_kafka.data_dir,
        heap=cfg.local_kafka.heap,
        secure=args.secure,
        users=args.user or (),
    )
    if state.reused:
        print(f"Kafka already running at {state.bootstrap}", file=sys.stderr)
    if state.secure:
        print(f"SASL_SSL (SCRAM-SHA-512) with ACLs; credentials (0600) in "
              f"{Path(state.data_dir) / 'credentials.json'}; config for a user: "
              f"rollout kafka creds --port {port} --user NAME", file=sys.stderr)  # fmt: skip
    print(state.bootstrap)
    return 0


def cmd_kafka_creds(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline import kafka_secure

    port = args.port or cfg.local_kafka.port
    data = kafka_secure.data_dir_for(port, args.data_dir or cfg.local_kafka.data_dir)
    bootstrap = f"localhost:{port}"
    if args.user not in kafka_secure.load_credentials(data).users:
        creds, added = kafka_secure.ensure_credentials(data, [args.user])
        admin = kafka_secure.client_config(bootstrap, data, kafka_secure.ADMIN_USER)
        kafka_secure.ensure_users(admin, creds, added)
        print(f"created user {args.user} (no ACLs yet: rollout kafka grant)", file=sys.stderr)
    if args.password:
        print(kafka_secure.load_credentials(data).password(args.user))
    else:
        sys.stdout.write(kafka_secure.config_snippet(bootstrap, data, args.user, port=port))
    return 0


def cmd_kafka_grant(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline import kafka_secure

    port = args.port or cfg.local_kafka.port
    data = kafka_secure.data_dir_for(port, args.data_dir or cfg.local_kafka.data_dir)
    admin = kafka_secure.client_config(f"localhost:{port}", data, kafka_secure.ADMIN_USER)
    names = [cfg.topics.name(t) if t in cfg.topics.ROLES else t for t in args.topic or []]
    count = kafka_secure.grant(
        admin,
        args.user,
        topics=names,
        operations=args.op or ("read", "write", "describe"),
        group=args.group,
        prefixed=args.prefixed,
    )
    print(f"granted {count} ACLs to User:{args.user}")
    return 0


def cmd_kafka_down(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.kafka_local import stop_broker

    port = args.port or cfg.local_kafka.port
    stopped = stop_broker(port, purge=args.purge)
    print(f"Kafka on port {port}: {'stopped' if stopped else 'was not running (not ours)'}")
    return 0


def cmd_kafka_status(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.kafka_local import broker_status

    status = broker_status(args.port or cfg.local_kafka.port)
    _print_json(status)
    return 0 if status["answering"] else 1


# --- topics --------------------------------------------------------------------------


def cmd_topics(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline import topics

    if args.action == "create":
        for name, outcome in topics.create_topics(cfg.kafka, cfg.topics).items():
            print(f"{name}\t{outcome}")
    elif args.action == "describe":
        for row in topics.describe_topics(cfg.kafka, cfg.topics):
            _print_json(row)
    else:
        for name in topics.delete_topics(cfg.kafka, cfg.topics):
            print(f"{name}\tdeleted")
    return 0


# --- data ----------------------------------------------------------------------------


def cmd_produce(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.producer import PromptProducer

    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        report = producer.produce_file(
            args.dataset,
            uid_prefix=args.uid_prefix or Path(args.dataset).stem,
            default_data_source=cfg.produce.default_data_source,
            limit=args.limit,
            rate=args.rate or cfg.produce.rate,
            progress=not args.quiet,
        )
    for error in report.errors[:20]:
        print(f"skipped {error}", file=sys.stderr)
    print(report.summary(), file=sys.stderr)
    _print_json(
        {"sent": report.sent, "skipped": report.skipped, "seconds": round(report.seconds, 3)}
    )
    return 0


def cmd_consume(args: argparse.Namespace, cfg: RunConfig) -> int:
    import time

    from workers.kafka.stream import EventStream

    topic = cfg.topics.name(args.topic) if args.topic in cfg.topics.ROLES else args.topic
    seen = 0
    deadline = time.monotonic() + args.timeout
    with EventStream(
        cfg.kafka, [topic], group_id=args.group, stage="consume", dlq_topic=cfg.topics.name("dlq")
    ) as stream:
        while time.monotonic() < deadline and (args.limit is None or seen < args.limit):
            for item in stream.poll(timeout_ms=500):
                sys.stdout.write(item.event.model_dump_json() + "\n")
                seen += 1
            if args.group:
                stream.commit()
    print(f"consumed {seen} events from {topic}", file=sys.stderr)
    return 0


def cmd_data_arith(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.data import arithmetic_rows, write_rows

    path = write_rows(
        arithmetic_rows(args.n, seed=args.seed, max_operand=args.max_operand), args.out
    )
    print(path)
    return 0


# --- model, replicas, workers ----------------------------------------------------


def cmd_model_init(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.llm.model_init import init_model

    out = init_model(args.out, preset=args.preset, seed=args.seed, reward_model=args.reward_model)
    print(out)
    return 0


def cmd_replica_serve(args: argparse.Namespace, cfg: RunConfig) -> int:
    import socket

    from schemas.events import ReplicaInfo
    from workers.llm.replicas import get_backend
    from workers.llm.replicas.registration import ReplicaRegistration

    backend = get_backend(args.backend)
    replica_id = args.replica_id or f"{args.backend}-{socket.gethostname()}-{args.port}"
    advertised = (
        args.advertise
        or f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '127.0.0.1') else args.host}:{args.port}"
    )
    registration = None
    if args.register:
        info = ReplicaInfo(
            replica_id=replica_id,
            address=advertised,
            backend=args.backend,
            model=args.model,
            version=args.version,
        )
        registration = ReplicaRegistration(cfg.kafka, cfg.topics.name("replicas"), info)
        registration.start()
    extra: dict[str, Any] = {}
    if args.backend == "hf":
        extra["threads"] = args.threads
    else:
        extra.update(tp=args.tp, dp=args.dp, pp=args.pp)
    try:
        result = backend.serve(args.model, args.host, args.port, replica_id, args.version, **extra)
    finally:
        if registration is not None:
            registration.leave()
    return int(result or 0)


def cmd_worker_agent_loop(args: argparse.Namespace, cfg: RunConfig) -> int:
    import asyncio
    import signal

    # A SIGTERM that arrives while the worker is still importing or connecting is a request
    # to stop, honoured gracefully once it runs (exit 0), not a crash.
    early_stop = _stop_event_on_signals()

    from workers.agent_loop.worker import AgentLoopWorker

    worker_cfg = cfg.agent_loop
    if args.model:
        worker_cfg = worker_cfg.model_copy(update={"model": args.model})
    if args.replica:
        worker_cfg = worker_cfg.model_copy(update={"replicas": args.replica})
    if not worker_cfg.model:
        raise ConfigError("agent_loop.model (or --model) must name the model directory")
    metrics = _metrics("agent-loop", args)

    async def main() -> int:
        worker = AgentLoopWorker(cfg.kafka, cfg.topics, worker_cfg, metrics=metrics)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        if early_stop.is_set():
            worker.stop()
        await worker.run()
        # Stopped because replicas or the broker failed a prompt (left unfinished, so it is
        # redelivered): EX_TEMPFAIL, so a supervisor starts the worker again.
        return 75 if worker.counters["prompts_failed"] else 0

    return asyncio.run(main())


def _metrics(stage: str, args: argparse.Namespace) -> Any:
    """The process's `StageMetrics`, served on `--metrics-port` (0 or absent: not served)."""
    from workers.metrics import StageMetrics, TrainerMetrics

    metrics = TrainerMetrics() if stage == "train" else StageMetrics(stage)  # type: ignore[arg-type]
    metrics.serve(args.metrics_port)
    return metrics


def _stop_event_on_signals() -> Any:
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_worker_reward(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.reward.worker import run_worker

    return int(run_worker(cfg.kafka, cfg.topics, cfg.reward, metrics=_metrics("reward", args)) or 0)


def cmd_worker_replay(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.replay.worker import run_worker

    return int(run_worker(cfg.kafka, cfg.topics, cfg.replay, metrics=_metrics("replay", args)) or 0)


def cmd_train(args: argparse.Namespace, cfg: RunConfig) -> int:
    from dataclasses import asdict

    from workers.trainer.trainer import run_trainer

    trainer_cfg = cfg.trainer
    if args.model:
        trainer_cfg = trainer_cfg.model_copy(update={"model_dir": args.model})
    stop, metrics = _stop_event_on_signals(), _metrics("train", args)
    result = run_trainer(cfg.kafka, cfg.topics, trainer_cfg, stop, metrics=metrics)
    _print_json(asdict(result))
    return 0


def cmd_replica_sync(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.trainer.controller import run_controller

    stop, metrics = _stop_event_on_signals(), _metrics("sync", args)
    run_controller(cfg.kafka, cfg.topics, args.replica, stop, metrics=metrics)
    return 0


def cmd_status(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.status import pipeline_status, render_status

    status = pipeline_status(cfg.kafka, cfg.topics, interval_s=args.interval)
    if args.json:
        _print_json(status)
    else:
        from rich.console import Console

        Console().print(render_status(status))
    return 0


def cmd_chaos(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.chaos.__main__ import main_with

    return main_with(args)


def cmd_demo(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.demo import run_demo

    run_demo(cfg, steps=args.steps, prompts=args.prompts)
    return 0


def cmd_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline import ray_launch

    model = args.model or cfg.trainer.model_dir or cfg.agent_loop.model
    if not model:
        raise ConfigError("--model (or trainer.model_dir) must name the model directory")
    model = str(Path(model).resolve())
    trainer = {"model_dir": cfg.trainer.model_dir or model}
    if args.steps is not None:
        trainer["max_steps"] = args.steps
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=trainer)})
    started = ray_launch.up(
        cfg, address=args.ray or None, model_dir=model, run_dir=args.run_dir or f"runs/{args.run}",
        run=args.run, replicas=args.replicas, replica_threads=args.replica_threads,
        agent_loop_workers=args.agent_loop_workers, backend=args.backend,
        parallel=(args.tp, args.dp, args.pp),
    )  # fmt: skip
    for row in started:
        _print_json(row)
    if not args.wait:
        return 0
    code = ray_launch.wait(args.ray or None, run=args.run, timeout_s=args.timeout)
    print(f"{args.run}/train exited with {code}", file=sys.stderr)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def cmd_down(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.ray_launch import down

    for name, code in down(args.ray or None, run=args.run, grace_s=args.grace).items():
        print(f"{name}\tstopped ({code})")
    return 0


# --- parser --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout", description="Streaming rollout pipeline for async off-policy RL on Kafka."
    )
    parser.add_argument("--config", help="YAML config file (else $ROLLOUT_CONFIG).")
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="Override a config field, e.g. topics.prefix=exp1.",
    )
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (kafka.bootstrap_servers).")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)

    kafka = sub.add_parser("kafka", help="Local Apache Kafka broker (KRaft, no Docker).")
    ksub = kafka.add_subparsers(dest="action", required=True)
    up = ksub.add_parser(
        "up", help="Start (or reuse) the local broker; prints the bootstrap address."
    )
    up.add_argument("--port", type=int)
    up.add_argument("--data-dir")
    up.add_argument(
        "--secure", action="store_true", help="SASL_SSL (SCRAM-SHA-512 over TLS) with ACLs."
    )
    up.add_argument(
        "--user", action="append", help="With --secure: a SCRAM user to create (repeat)."
    )
    up.set_defaults(handler=cmd_kafka_up)
    creds = ksub.add_parser(
        "creds", help="Secure broker: a user's `kafka:` config (creating the user if new)."
    )
    creds.add_argument("--port", type=int)
    creds.add_argument("--data-dir")
    creds.add_argument("--user", default="admin")
    creds.add_argument(
        "--password",
        action="store_true",
        help="Print only the password, e.g. for export ROLLOUT_KAFKA__SASL_PASSWORD=$(…).",
    )
    creds.set_defaults(handler=cmd_kafka_creds)
    grant = ksub.add_parser("grant", help="Secure broker: allow a user topics and a group.")
    grant.add_argument("--port", type=int)
    grant.add_argument("--data-dir")
    grant.add_argument("--user", required=True)
    grant.add_argument(
        "--topic", action="append", help="Topic name or role (prompts, replay, …); repeat."
    )
    grant.add_argument(
        "--op",
        action="append",
        choices=["read", "write", "describe", "create", "delete", "alter", "describe_configs"],
        help="Operation on the topics (repeat); default read, write, describe.",
    )
    grant.add_argument("--group", help="Consumer group the user may join (READ).")
    grant.add_argument("--prefixed", action="store_true", help="Names are prefixes.")
    grant.set_defaults(handler=cmd_kafka_grant)
    down = ksub.add_parser("down", help="Stop the broker started by `up`.")
    down.add_argument("--port", type=int)
    down.add_argument("--purge", action="store_true", help="Delete its data directory too.")
    down.set_defaults(handler=cmd_kafka_down)
    status = ksub.add_parser("status", help="Is the local broker answering?")
    status.add_argument("--port", type=int)
    status.set_defaults(handler=cmd_kafka_status)

    topics = sub.add_parser("topics", help="Create, describe or delete the pipeline's topics.")
    topics.add_argument("action", choices=["create", "describe", "delete"])
    topics.set_defaults(handler=cmd_topics)

    produce = sub.add_parser("produce", help="Produce a verl-format dataset to the prompts topic.")
    produce.add_argument("--dataset", required=True, help=".parquet, .jsonl or .json")
    produce.add_argument("--limit", type=int)
    produce.add_argument(
        "--rate", type=float, help="Prompts per second (default: as fast as possible)."
    )
    produce.add_argument("--uid-prefix", help="Prefix of generated uids (default: file stem).")
    produce.add_argument("--quiet", action="store_true", help="No progress bar.")
    produce.set_defaults(handler=cmd_produce)

    consume = sub.add_parser("consume", help="Print a topic's events as JSON lines.")
    consume.add_argument(
        "--topic", default="prompts", help="A role (prompts, turns, …) or a topic name."
    )
    consume.add_argument(
        "--group", help="Consumer group (committed); default: none, from the start."
    )
    consume.add_argument("--limit", type=int)
    consume.add_argument(
        "--timeout", type=float, default=10.0, help="Stop after this many seconds."
    )
    consume.set_defaults(handler=cmd_consume)

    data = sub.add_parser("data", help="Generate datasets.")
    dsub = data.add_subparsers(dest="action", required=True)
    arith = dsub.add_parser("arith", help="Arithmetic questions in gsm8k format.")
    arith.add_argument("--out", required=True, help=".jsonl or .parquet")
    arith.add_argument("--n", type=int, default=1000)
    arith.add_argument("--seed", type=int, default=0)
    arith.add_argument("--max-operand", type=int, default=20)
    arith.set_defaults(handler=cmd_data_arith)

    model = sub.add_parser("model", help="The project's own tiny models.")
    msub = model.add_subparsers(dest="action", required=True)
    minit = msub.add_parser("init", help="Write a randomly initialised Qwen2 model + tokenizer.")
    minit.add_argument("--out", required=True)
    minit.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    minit.add_argument("--seed", type=int, default=0)
    minit.add_argument(
        "--reward-model", action="store_true", help="A sequence-classification head."
    )
    minit.set_defaults(handler=cmd_model_init)

    replica = sub.add_parser("replica", help="Inference replicas.")
    rsub = replica.add_subparsers(dest="action", required=True)
    serve = rsub.add_parser("serve", help="Serve the replica contract over HTTP.")
    serve.add_argument("--backend", default="hf", help="hf (CPU), vllm, sglang")
    serve.add_argument("--model", required=True, help="Model directory.")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--replica-id")
    serve.add_argument(
        "--version", type=int, default=0, help="Policy version of the weights at start."
    )
    serve.add_argument("--threads", type=int, default=2, help="torch threads (hf).")
    serve.add_argument("--register", action="store_true", help="Announce on the replicas topic.")
    serve.add_argument("--advertise", help="Address others reach it at (default http://host:port).")
    for flag, what in (("--tp", "Tensor"), ("--dp", "Data"), ("--pp", "Pipeline")):
        serve.add_argument(flag, type=int, default=1, help=f"{what}-parallel size (vllm).")
    serve.set_defaults(handler=cmd_replica_serve)

    sync = rsub.add_parser("sync", help="Load each new policy version into a replica.")
    sync.add_argument("--replica", required=True, help="The replica's URL.")
    _add_metrics_port(sync)
    sync.set_defaults(handler=cmd_replica_sync)

    train = sub.add_parser("train", help="The off-policy trainer on the replay topic.")
    train.add_argument("--model", help="Model directory (trainer.model_dir).")
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
    _add_metrics_port(reward)
    reward.set_defaults(handler=cmd_worker_reward)
    replay = wsub.add_parser(
        "replay", help="rl.scored → groups, staleness, advantages → rl.replay."
    )
    _add_metrics_port(replay)
    replay.set_defaults(handler=cmd_worker_replay)

    overview = sub.add_parser("status", help="Lag, rates, policy version, replicas, dead letters.")
    overview.add_argument(
        "--interval", type=float, default=2.0, help="Seconds between rate samples."
    )
    overview.add_argument("--json", action="store_true")
    overview.set_defaults(handler=cmd_status)

    demo = sub.add_parser("demo", help="Train the tiny model with the whole pipeline, locally.")
    demo.add_argument("--steps", type=int, default=None, help="Trainer steps (default: recipe).")
    demo.add_argument(
        "--prompts", type=int, default=None, help="Prompts to produce (default: enough for steps)."
    )
    demo.set_defaults(handler=cmd_demo)

    chaos = sub.add_parser(
        "chaos", help="Kill, stop and restart every stage; account for every sample."
    )
    add_chaos_arguments(chaos)
    chaos.set_defaults(handler=cmd_chaos)

    ray_up = sub.add_parser("up", help="Start the whole pipeline as Ray actors (detached).")
    ray_up.add_argument(
        "--ray",
        nargs="?",
        const="",
        required=True,
        metavar="ADDRESS",
        help="Ray cluster to join; none: the local one (started if absent).",
    )
    ray_up.add_argument("--run", default="default", help="Run name: actors are RUN/<stage>.")
    ray_up.add_argument("--model", help="Model directory (default: trainer.model_dir).")
    ray_up.add_argument("--run-dir", help="Config and logs; shared storage on several nodes.")
    ray_up.add_argument("--replicas", type=int, default=2)
    ray_up.add_argument("--replica-threads", type=int, default=1, help="torch threads (hf).")
    ray_up.add_argument("--agent-loop-workers", type=int, default=1)
    ray_up.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    for flag, what in (("--tp", "Tensor"), ("--dp", "Data"), ("--pp", "Pipeline")):
        ray_up.add_argument(flag, type=int, default=1, help=f"{what}-parallel size (vllm).")
    ray_up.add_argument("--steps", type=int, help="Trainer steps (trainer.max_steps).")
    ray_up.add_argument("--wait", action="store_true", help="Block until the trainer exits.")
    ray_up.add_argument("--timeout", type=float, help="With --wait: give up after seconds.")
    ray_up.set_defaults(handler=cmd_up)
    ray_down = sub.add_parser("down", help="Stop the pipeline's Ray actors and their processes.")
    ray_down.add_argument("--ray", nargs="?", const="", default="", metavar="ADDRESS")
    ray_down.add_argument("--run", help="Only this run (default: every run).")
    ray_down.add_argument("--grace", type=float, default=20.0, help="Seconds before SIGKILL.")
    ray_down.set_defaults(handler=cmd_down)

    add_bench_parsers(sub)
    add_load_parser(sub)

    return parser


def _add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="Serve Prometheus metrics at http://0.0.0.0:PORT/metrics (0: off).",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = _config(args)
        handler: Handler = args.handler
        return handler(args, cfg)
    except ConfigError as exc:
        print(f"rollout: {exc}", file=sys.stderr)
        return 2
    except RolloutError as exc:
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `rollout consume | head`: the reader left; not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
