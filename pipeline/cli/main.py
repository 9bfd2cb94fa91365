"""`rollout`: the command line of the pipeline, one parser for every command.

Parses the config first and imports heavy modules (kafka clients, torch) only inside the
command that needs them, so `rollout --help` is instant and a test checks that importing
this module pulls in neither torch nor vllm. Every command lives in the module of its area
(`AREAS`, in `--help` order); each area has one `add_parsers(sub)` that adds its commands and
sets each one's `handler(args, cfg)`. Shared helpers are in `pipeline.cli.common`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.cli import bench, chaos, data, demo, kafka, load, ray, stages, status
from pipeline.cli.common import Handler, failed
from pipeline.config import ConfigError, RunConfig, load_config, parse_overrides
from schemas.errors import RolloutError
from workers.kafka.client_logs import route_client_logs

__all__ = ["build_parser", "main"]

AREAS = (kafka, data, stages, status, demo, chaos, ray, bench, load)


def _config(args: argparse.Namespace) -> RunConfig:
    overrides = parse_overrides(args.set or [])
    if args.bootstrap:
        overrides.setdefault("kafka", {})["bootstrap_servers"] = args.bootstrap
    return load_config(args.config, overrides)


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
    for area in AREAS:
        area.add_parsers(sub)
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
