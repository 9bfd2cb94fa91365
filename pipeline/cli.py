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

from pipeline.config import ConfigError, RunConfig, load_config, parse_overrides
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
    state = start_broker(port, args.data_dir or cfg.local_kafka.data_dir, heap=cfg.local_kafka.heap)
    if state.reused:
        print(f"Kafka already running at {state.bootstrap}", file=sys.stderr)
    print(state.bootstrap)
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
    _print_json({"sent": report.sent, "skipped": report.skipped, "seconds": round(report.seconds, 3)})
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

    path = write_rows(arithmetic_rows(args.n, seed=args.seed, max_operand=args.max_operand), args.out)
    print(path)
    return 0


def cmd_demo(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.demo import run_demo

    run_demo(cfg, prompts=args.prompts)
    return 0


# --- bench ---------------------------------------------------------------------------


def cmd_bench_serialization(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.bench.serialization import run

    result = run(tokens=args.tokens, rounds=args.rounds)
    _emit(result, args.json)
    return 0


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(result)
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")


# --- parser --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout", description="Streaming rollout pipeline for async off-policy RL on Kafka."
    )
    parser.add_argument("--config", help="YAML config file (else $ROLLOUT_CONFIG).")
    parser.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="Override a config field, e.g. topics.prefix=exp1."
    )
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (kafka.bootstrap_servers).")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)

    kafka = sub.add_parser("kafka", help="Local Apache Kafka broker (KRaft, no Docker).")
    ksub = kafka.add_subparsers(dest="action", required=True)
    up = ksub.add_parser("up", help="Start (or reuse) the local broker; prints the bootstrap address.")
    up.add_argument("--port", type=int)
    up.add_argument("--data-dir")
    up.set_defaults(handler=cmd_kafka_up)
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
    produce.add_argument("--rate", type=float, help="Prompts per second (default: as fast as possible).")
    produce.add_argument("--uid-prefix", help="Prefix of generated uids (default: file stem).")
    produce.add_argument("--quiet", action="store_true", help="No progress bar.")
    produce.set_defaults(handler=cmd_produce)

    consume = sub.add_parser("consume", help="Print a topic's events as JSON lines.")
    consume.add_argument("--topic", default="prompts", help="A role (prompts, turns, …) or a topic name.")
    consume.add_argument("--group", help="Consumer group (committed); default: none, from the start.")
    consume.add_argument("--limit", type=int)
    consume.add_argument("--timeout", type=float, default=10.0, help="Stop after this many seconds.")
    consume.set_defaults(handler=cmd_consume)

    data = sub.add_parser("data", help="Generate datasets.")
    dsub = data.add_subparsers(dest="action", required=True)
    arith = dsub.add_parser("arith", help="Arithmetic questions in gsm8k format.")
    arith.add_argument("--out", required=True, help=".jsonl or .parquet")
    arith.add_argument("--n", type=int, default=1000)
    arith.add_argument("--seed", type=int, default=0)
    arith.add_argument("--max-operand", type=int, default=20)
    arith.set_defaults(handler=cmd_data_arith)

    demo = sub.add_parser("demo", help="Run the pipeline end to end on a local broker.")
    demo.add_argument("--prompts", type=int, default=64)
    demo.set_defaults(handler=cmd_demo)

    bench = sub.add_parser("bench", help="Benchmarks; each prints one JSON object with --json.")
    bsub = bench.add_subparsers(dest="benchmark", required=True)
    ser = bsub.add_parser("serialization", help="Wire codec vs plain JSON lists.")
    ser.add_argument("--tokens", type=int, default=4096)
    ser.add_argument("--rounds", type=int, default=5)
    ser.add_argument("--json", action="store_true")
    ser.set_defaults(handler=cmd_bench_serialization)

    return parser


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
