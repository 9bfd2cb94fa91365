"""`rollout load`: the soak, its tables on stdout, exit 1 when it found a problem.

Light at import (the CLI's `--help` stays instant): the run's modules load inside the command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig

__all__ = ["add_load_parser"]


def cmd_load(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.load.figures import render
    from pipeline.load.run import LoadOptions, run_load

    opts = LoadOptions(
        minutes=args.minutes,
        baseline_minute=args.baseline_minute,
        sample_s=args.sample_s,
        replicas=args.replicas,
        agent_loop_workers=args.workers,
        max_tokens=args.max_tokens,
        backlog=args.backlog,
        memory_limit_pct=args.memory_limit,
        model_dir=args.model,
        run_dir=args.run_dir,
    )
    report = run_load(cfg.kafka, opts)
    text = render(report)
    Path(report["run_dir"], "report.txt").write_text(text + "\n")
    print(text)
    print(f"run: {report['run_dir']}")
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    return 0 if report["ok"] else 1


def add_load_parser(sub: Any) -> None:
    load = sub.add_parser(
        "load", help="Soak: the whole pipeline at its highest sustained rate for N minutes."
    )
    load.add_argument("--minutes", type=float, default=10.0, help="Minutes of load (default 10).")
    load.add_argument(
        "--baseline-minute",
        type=float,
        default=2.0,
        help="Memory growth and throughput are measured from this minute to the end.",
    )
    load.add_argument(
        "--sample-s", type=float, default=15.0, help="Seconds between lag/memory samples."
    )
    load.add_argument("--replicas", type=int, default=2, help="hf replicas.")
    load.add_argument("--workers", type=int, default=1, help="Agent-loop worker processes.")
    load.add_argument("--max-tokens", type=int, default=16, help="Tokens per response.")
    load.add_argument(
        "--backlog", type=int, help="Prompts kept waiting (default: twice what workers hold)."
    )
    load.add_argument(
        "--memory-limit", type=float, default=20.0, help="Allowed RSS growth, percent."
    )
    load.add_argument("--model", help="Policy model directory (default: the tiny model).")
    load.add_argument("--run-dir", help="Where logs and the report go (default reports/load-*).")
    load.add_argument("--json", action="store_true", help="Print the report as JSON too.")
    load.set_defaults(handler=cmd_load)
