"""`rollout up --ray [ADDRESS]`, `rollout down`: the whole pipeline as Ray actors."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.common import checked_model_dir, print_json
from pipeline.config import ConfigError, RunConfig

__all__ = ["add_parsers"]


def cmd_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.launch.ray import stages as ray_launch

    model = args.model or cfg.trainer.model_dir or cfg.agent_loop.model
    if not model:
        raise ConfigError("--model (or trainer.model_dir) must name the model directory")
    model = str(Path(checked_model_dir(model, "--model" if args.model else "model")).resolve())
    trainer = {"model_dir": cfg.trainer.model_dir or model}
    if args.steps is not None:
        trainer["max_steps"] = args.steps
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=trainer)})
    judge = cfg.reward.judge
    if judge.enable and judge.model:  # its replicas start in the checkout: an absolute path
        where = str(Path(checked_model_dir(judge.model, "reward.judge.model")).resolve())
        judge = judge.model_copy(update={"model": where})
        cfg = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"judge": judge})})
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
    from pipeline.launch.ray.stages import down

    for name, code in down(args.ray or None, run=args.run, grace_s=args.grace).items():
        print(f"{name}\tstopped ({code})")
    return 0


def add_parsers(sub: Any) -> None:
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
    ray_up.add_argument("--wait", action="store_true", help="Block until the trainer exits.")
    ray_up.add_argument("--timeout", type=float, help="With --wait: give up after seconds.")
    ray_up.set_defaults(handler=cmd_up)
    ray_down = sub.add_parser("down", help="Stop the pipeline's Ray actors and their processes.")
    ray_down.add_argument(
        "--ray",
        nargs="?",
        const="",
        default="",
        metavar="ADDRESS",
        help="Ray cluster the run is on (default: the local one).",
    )
    ray_down.add_argument("--run", help="Only this run (default: every run).")
    ray_down.add_argument("--grace", type=float, default=20.0, help="Seconds before SIGKILL.")
    ray_down.set_defaults(handler=cmd_down)
