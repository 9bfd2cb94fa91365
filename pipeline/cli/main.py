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

from pipeline.cli import bench, chaos, config, data, demo, kafka, load, ray, stages, status
from pipeline.cli.common import Handler, failed
from pipeline.config import ConfigError, RunConfig, load_config, parse_overrides
from schemas.errors import RolloutError
from workers.kafka.client_logs import route_client_logs

__all__ = ["build_parser", "main"]

AREAS = (kafka, data, stages, status, config, demo, chaos, ray, bench, load)


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
    _add_global_flags(parser, late=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for area in AREAS:
        area.add_parsers(sub)
    for command in _commands(parser):
        _add_global_flags(command, late=True)
    return parser


def _add_global_flags(parser: argparse.ArgumentParser, *, late: bool) -> None:
    """The flags every command takes, before its name (`rollout --set k=v produce`) or after
    it (`rollout produce --set k=v`). After it they land in `late_*` and are merged by
    `_merge_late`: a later `--config`/`--bootstrap` wins, `--set` and `-v` add up."""
    dest = "late_" if late else ""
    default = argparse.SUPPRESS if late else None
    parser.add_argument(
        "--config",
        dest=f"{dest}config",
        default=default,
        help="YAML config file (else $ROLLOUT_CONFIG).",
    )
    parser.add_argument(
        "--set",
        dest=f"{dest}set",
        default=default,
        action="append",
        metavar="KEY=VALUE",
        help="Override a config field, e.g. topics.prefix=exp1 (repeat).",
    )
    parser.add_argument(
        "--bootstrap",
        dest=f"{dest}bootstrap",
        default=default,
        metavar="HOST:PORT[,…]",
        help="Kafka bootstrap servers (kafka.bootstrap_servers).",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        dest=f"{dest}verbose",
        action="count",
        default=argparse.SUPPRESS if late else 0,
        help="More log output (-vv: debug).",
    )


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser that runs a command (the leaves of the subcommand tree)."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return [parser]
    children = {id(p): p for a in actions for p in a.choices.values()}.values()
    return [leaf for child in children for leaf in _commands(child)]


def _merge_late(args: argparse.Namespace) -> argparse.Namespace:
    for name in ("config", "bootstrap"):
        late = getattr(args, f"late_{name}", None)
        if late is not None:
            setattr(args, name, late)
    args.set = [*(args.set or []), *getattr(args, "late_set", [])] or None
    args.verbose += getattr(args, "late_verbose", 0)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _merge_late(parser.parse_args(argv))
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
    except RolloutError as exc:  # a stage's temporary failure carries its exit status (75)
        return failed(str(exc), getattr(exc, "exit_code", 1))
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
