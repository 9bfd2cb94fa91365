"""`rollout up [--ray [ADDRESS]]`, `rollout down [--local]`: the whole pipeline from one config.

With `--ray`, as Ray actors (detached; `rollout down` stops them); without it, on this
machine in the foreground (`pipeline.cli.local_up`; `rollout down --local` stops it)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.cli.common import print_json
from pipeline.cli.local_up import cmd_down_local, cmd_up_local, resolved_models
from pipeline.config import RunConfig

__all__ = ["add_parsers"]


def cmd_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    if args.ray is None:
        return cmd_up_local(args, cfg)
    from pipeline.launch.ray import stages as ray_launch

    cfg, model = resolved_models(args, cfg)
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
    if args.local:
        return cmd_down_local(args, cfg)
    from pipeline.launch.ray.stages import down

    for name, code in down(args.ray or None, run=args.run, grace_s=args.grace).items():
        print(f"{name}\tstopped ({code})")
    return 0


def add_parsers(sub: Any) -> None:
    ray_up = sub.add_parser(
        "up",
        help="Start the whole pipeline: here in the foreground, or as Ray actors with --ray.",
    )
    ray_up.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="Run as detached Ray actors on this cluster; no ADDRESS: the local one (started "
        "if absent). Without --ray: every stage a process here, until the trainer is done.",
    )
    ray_up.add_argument("--run", default="default", help="Run name: actors are RUN/<stage>.")
    ray_up.add_argument("--model", help="Model directory (default: trainer.model_dir).")
    ray_up.add_argument(
        "--run-dir",
        help="Config and logs (default runs/RUN); shared storage on several nodes.",
    )
    ray_up.add_argument("--replicas", type=int, default=2, help="Inference replicas.")
    ray_up.add_argument("--replica-threads", type=int, default=1, help="torch threads (hf).")
    ray_up.add_argument(
        "--agent-loop-workers", type=int, default=1, help="Agent-loop worker processes."
    )
    ray_up.add_argument(
        "--backend", choices=["hf", "vllm"], default="hf", help="Replica engine (default: hf)."
    )
    for flag, what in (("--tp", "Tensor"), ("--dp", "Data"), ("--pp", "Pipeline")):
        ray_up.add_argument(flag, type=int, default=1, help=f"{what}-parallel size (vllm).")
    ray_up.add_argument("--steps", type=int, help="Trainer steps (trainer.max_steps).")
    ray_up.add_argument(
        "--wait", action="store_true", help="With --ray: block until the trainer exits."
    )
    ray_up.add_argument(
        "--timeout", type=float, help="Give up after seconds (--ray: with --wait; here: stop)."
    )
    ray_up.set_defaults(handler=cmd_up)
    ray_down = sub.add_parser(
        "down", help="Stop the pipeline's Ray actors (or, with --local, a local `rollout up`)."
    )
    ray_down.add_argument(
        "--ray",
        nargs="?",
        const="",
        default="",
        metavar="ADDRESS",
        help="Ray cluster the run is on (default: the local one).",
    )
    ray_down.add_argument(
        "--local",
        action="store_true",
        help="Stop the `rollout up` running here for --run-dir (default runs/RUN).",
    )
    ray_down.add_argument("--run-dir", help="With --local: the run's directory.")
    ray_down.add_argument("--run", help="Only this run (default: every run; --local: default).")
    ray_down.add_argument("--grace", type=float, default=20.0, help="Seconds before SIGKILL.")
    ray_down.set_defaults(handler=cmd_down)
