"""`rollout status`: lag, rates, policy version, replicas and dead letters of a running pipeline."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.cli.common import print_json
from pipeline.config import RunConfig

__all__ = ["add_parsers"]


def cmd_status(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.observe.status import pipeline_status, render_status

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


def add_parsers(sub: Any) -> None:
    overview = sub.add_parser("status", help="Lag, rates, policy version, replicas, dead letters.")
    overview.add_argument(
        "--interval", type=float, default=2.0, help="Seconds between rate samples."
    )
    overview.add_argument("--json", action="store_true", help="Print one JSON object.")
    overview.set_defaults(handler=cmd_status)
