"""`rollout`: the command line of the pipeline.

Parses the config first and imports heavy modules (kafka clients, torch) only inside the
command that needs them, so `rollout --help` is instant and a test checks that importing
this module pulls in neither torch nor vllm. The commands live by area: `cli_kafka` (broker,
topics), `cli_stages` (replicas, workers, trainer), `bench.cli`, `load.cli`, `chaos`; this
module has the data, status, demo and Ray commands, the parser and `main`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.cli import add_bench_parsers
from pipeline.chaos.__main__ import add_arguments as add_chaos_arguments
from pipeline.cli_kafka import add_kafka_parsers, failed, print_json
from pipeline.cli_stages import add_stage_parsers, checked_model_dir
from pipeline.config import ConfigError, RunConfig, load_config, parse_overrides
from pipeline.load.cli import add_load_parser
from schemas.errors import RolloutError
from workers.kafka.client_logs import route_client_logs

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace, RunConfig], int]


def _config(args: argparse.Namespace) -> RunConfig:
    overrides = parse_overrides(args.set or [])
    if args.bootstrap:
        overrides.setdefault("kafka", {})["bootstrap_servers"] = args.bootstrap
    return load_config(args.config, overrides)


# --- data ----------------------------------------------------------------------------


def cmd_produce(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.datasets import read_rows
    from pipeline.producer import PromptProducer
    from pipeline.topics import require_topics

    rows = read_rows(args.dataset)  # a wrong path or format fails here, before Kafka
    for name, outcome in require_topics(cfg.kafka, cfg.topics, ["prompts"]).items():
        print(f"{name}\t{outcome}", file=sys.stderr)
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        report = producer.produce_rows(
            rows,
            uid_prefix=args.uid_prefix or Path(args.dataset).stem,
            default_data_source=cfg.produce.default_data_source,
            limit=args.limit,
            rate=args.rate or cfg.produce.rate,
            progress=not args.quiet,
        )
    for error in report.errors[:20]:
        print(f"skipped {error}", file=sys.stderr)
    if len(report.errors) > 20:
        print(f"… and {len(report.errors) - 20} more", file=sys.stderr)
    print(report.summary(), file=sys.stderr)
    print_json(
        {"sent": report.sent, "skipped": report.skipped, "seconds": round(report.seconds, 3)}
    )
    if report.sent == 0 and args.limit != 0:
        what = "no valid row" if report.skipped else "no rows"
        print(f"rollout: error: nothing produced: {args.dataset} has {what}", file=sys.stderr)
        return 1
    return 0


def cmd_consume(args: argparse.Namespace, cfg: RunConfig) -> int:
    import time

    from workers.kafka.admin import missing_topics
    from workers.kafka.exceptions import MissingTopicsError
    from workers.kafka.stream import EventStream

    topic = cfg.topics.name(args.topic) if args.topic in cfg.topics.ROLES else args.topic
    if missing_topics(cfg.kafka, [topic]):
        raise MissingTopicsError(
            f"topic {topic} not found at {cfg.kafka.bootstrap}; `rollout topics create` "
            "creates the run's topics, `rollout produce` fills rl.prompts",
            topics=[topic],
        )
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
    from pipeline.arithmetic import arithmetic_rows, write_rows

    if Path(args.out).suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"--out {args.out}: the name must end in .jsonl or .parquet")
    _writable_dir(Path(args.out).parent, "--out")
    path = write_rows(
        arithmetic_rows(args.n, seed=args.seed, max_operand=args.max_operand), args.out
    )
    print(path)
    return 0


# --- model, replicas, workers ----------------------------------------------------


def cmd_model_init(args: argparse.Namespace, cfg: RunConfig) -> int:
    from workers.llm.model_init import init_model

    _writable_dir(Path(args.out), "--out")
    out = init_model(args.out, preset=args.preset, seed=args.seed, reward_model=args.reward_model)
    print(out)
    return 0


def _writable_dir(path: Path, what: str) -> None:
    """Create `path` (and its parents) now, so an output the user cannot write is one line
    before the work, not an OSError traceback after it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create directory {path}: {exc.strerror or exc}") from exc


def cmd_status(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.status import pipeline_status, render_status

    status = pipeline_status(cfg.kafka, cfg.topics, interval_s=args.interval)
    if args.json:
        print_json(status)
    else:
        from rich.console import Console

        Console().print(render_status(status))
    if not status["topics"]:
        print(
            f"rollout: no {cfg.topics.prefix}* topics at {cfg.kafka.bootstrap} yet; "
            "`rollout topics create` creates them",
            file=sys.stderr,
        )
    return 0


def cmd_chaos(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.chaos.__main__ import main_with

    return main_with(args)


def cmd_demo(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.demo import run_demo

    run_demo(cfg, steps=args.steps, prompts=args.prompts, backend=args.backend)
    return 0


def cmd_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline import ray_launch

    model = args.model or cfg.trainer.model_dir or cfg.agent_loop.model
    if not model:
        raise ConfigError("--model (or trainer.model_dir) must name the model directory")
    model = str(Path(checked_model_dir(model, "--model" if args.model else "model")).resolve())
    trainer = {"model_dir": cfg.trainer.model_dir or model}
    if args.steps is not None:
        trainer["max_steps"] = args.steps
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=trainer)})
    started = ray_launch.up(
        cfg,
        address=args.ray or None,
        model_dir=model,
        run_dir=args.run_dir or f"runs/{args.run}",
        run=args.run,
        replicas=args.replicas,
        replica_threads=args.replica_threads,
        agent_loop_workers=args.agent_loop_workers,
        backend=args.backend,
        parallel=(args.tp, args.dp, args.pp),
    )
    for row in started:
        print_json(row)
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


def _at_least(
    low: float, kind: Callable[[str], Any], *, strict: bool = False
) -> Callable[[str], Any]:
    """An argparse type: `kind(text)`, refused (one usage line) below `low`, or at it if strict."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}: {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


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
    add_kafka_parsers(sub)
    produce = sub.add_parser("produce", help="Produce a verl-format dataset to the prompts topic.")
    produce.add_argument("--dataset", required=True, help=".parquet, .jsonl or .json")
    produce.add_argument("--limit", type=_at_least(0, int), help="Produce at most this many.")
    produce.add_argument(
        "--rate",
        type=_at_least(0, float, strict=True),
        help="Prompts per second (default: as fast as possible).",
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

    add_stage_parsers(sub)

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
    demo.add_argument(
        "--backend", choices=["hf", "vllm"], default="hf", help="Replicas (vllm: .venv-vllm)."
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    route_client_logs(args.verbose)
    cfg: RunConfig | None = None
    try:
        cfg = _config(args)
        handler: Handler = args.handler
        return handler(args, cfg)
    except ConfigError as exc:
        print(f"rollout: {exc}", file=sys.stderr)
        return 2
    except RolloutError as exc:
        return failed(str(exc))
    except _client_errors() as exc:
        # A Kafka client's error that no command translated: still the user's broker or
        # network, so one line, not a traceback.
        where = f" at {cfg.kafka.bootstrap}" if cfg is not None else ""
        return failed(f"Kafka{where}: {exc}")
    except KeyboardInterrupt:
        print("rollout: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `rollout consume | head`: the reader left; not an error of ours.
        sys.stderr.close()
        return 0


def _client_errors() -> tuple[type[BaseException], ...]:
    """The error roots of the Kafka client libraries this run imported. Looked up only when
    an error propagates, so the CLI itself imports neither (`--help` stays instant)."""
    roots: list[type[BaseException]] = []
    for module in ("kafka.errors", "aiokafka.errors"):
        if module in sys.modules:
            roots.append(sys.modules[module].KafkaError)
    return tuple(roots)


if __name__ == "__main__":
    sys.exit(main())
