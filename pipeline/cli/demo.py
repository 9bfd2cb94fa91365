"""`rollout demo`: the whole pipeline trains the tiny model on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.config import RunConfig

__all__ = ["add_parsers"]


def cmd_demo(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.harness.demo.run import run_demo

    run_demo(cfg, steps=args.steps, prompts=args.prompts, backend=args.backend)
    return 0


def add_parsers(sub: Any) -> None:
    demo = sub.add_parser("demo", help="Train the tiny model with the whole pipeline, locally.")
    demo.add_argument("--steps", type=int, default=None, help="Trainer steps (default: recipe).")
    demo.add_argument(
        "--prompts", type=int, default=None, help="Prompts to produce (default: enough for steps)."
    )
    demo.add_argument(
        "--backend", choices=["hf", "vllm"], default="hf", help="Replicas (vllm: .venv-vllm)."
    )
    demo.set_defaults(handler=cmd_demo)
