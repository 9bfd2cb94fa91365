"""`rollout load`: the soak, its tables on stdout, exit 1 when it found a problem.

Light at import (the CLI's `--help` stays instant): the run's modules load inside the command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.options import add_options, options_from
from pipeline.config import RunConfig
from pipeline.harness.load.options import LoadOptions

__all__ = ["add_parsers"]


def cmd_load(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.harness.load.figures import render
    from pipeline.harness.load.run import run_load

    opts = options_from(args, LoadOptions)
    report = run_load(cfg.kafka, opts)
    text = render(report)
    Path(report["run_dir"], "report.txt").write_text(text + "\n")
    print(text)
    print(f"run: {report['run_dir']}")
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    return 0 if report["ok"] else 1


def add_parsers(sub: Any) -> None:
    load = sub.add_parser(
        "load", help="Soak: the whole pipeline at its highest sustained rate for N minutes."
    )
    add_options(load, LoadOptions)
    load.add_argument("--json", action="store_true", help="Print the report as JSON too.")
    load.set_defaults(handler=cmd_load)
