"""`rollout up [--ray [ADDRESS]]`, `rollout down [--ray [ADDRESS]]`: the whole pipeline from
one config, here or on Ray.

Both default to this machine: `up` runs every stage as a process here in the foreground
(`pipeline.cli.local_up`), and `down` stops such a run from another shell. With `--ray`, `up`
starts the stages as detached Ray actors and `down --ray` stops them. A run is named after its
topics (`--run`, default `topics.prefix` without its trailing dot)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.cli.common import print_json
from pipeline.cli.local_up import (
    cmd_down_local,
    cmd_up_local,
    resolved_models,
    run_name_of,
    stages_of,
)
from pipeline.config import RunConfig
from pipeline.launch.local import STOP_GRACE_S

__all__ = ["add_parsers"]


def cmd_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    if args.ray is None:
        return cmd_up_local(args, cfg)
    from pipeline.launch.ray import stages as ray_launch

    cfg, model = resolved_models(args, cfg)
    run = run_name_of(args, cfg)
    started = ray_launch.up(
        cfg,
        address=args.ray or None,
        model_dir=model,
        run_dir=args.run_dir or f"runs/{run}",
        run=run,
        replicas=args.replicas,
        replica_threads=args.replica_threads,
        agent_loop_workers=args.agent_loop_workers,
        backend=args.backend,
        parallel=(args.tp, args.dp, args.pp),
        stages=stages_of(args),
    )
    for row in started:
        print_json(row)
    if not args.wait:
        return 0
    code = ray_launch.wait(args.ray or None, run=run, timeout_s=args.timeout)
    print(f"{run}/train exited with {code}", file=sys.stderr)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def cmd_down(args: argparse.Namespace, cfg: RunConfig) -> int:
    if args.ray is None:
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
    ray_up.add_argument(
        "--run",
        help="Run name (default: topics.prefix without its dot); Ray actors are RUN/<stage>.",
    )
    ray_up.add_argument("--model", help="Model directory (default: trainer.model_dir).")
    ray_up.add_argument(
        "--run-dir",
        help="Config, logs, checkpoints and report (default runs/RUN here); shared storage "
        "on several nodes.",
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
        "--no-trainer",
        action="store_true",
        help="Every stage but the trainer, for a trainer of your own (examples/own_trainer.py); "
        "runs until Ctrl-C or `rollout down`.",
    )
    ray_up.add_argument(
        "--wait", action="store_true", help="With --ray: block until the trainer exits."
    )
    ray_up.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="Without --ray: GPUs of this machine to share out (default: CUDA_VISIBLE_DEVICES, "
        "else nvidia-smi's). Each replica gets TP x DP x PP of them, the trainer one a rank.",
    )
    ray_up.add_argument(
        "--grace",
        type=float,
        default=STOP_GRACE_S,
        help="Without --ray: seconds a stopping run gives its processes before SIGKILL.",
    )
    ray_up.add_argument(
        "--timeout", type=float, help="Give up after seconds (--ray: with --wait; here: stop)."
    )
    ray_up.set_defaults(handler=cmd_up)
    ray_down = sub.add_parser(
        "down", help="Stop a run: the `rollout up` running here, or with --ray its Ray actors."
    )
    ray_down.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="Stop the run's Ray actors on this cluster (no ADDRESS: the local one). Without "
        "--ray: the `rollout up` running here for --run-dir.",
    )
    ray_down.add_argument("--local", action="store_true", help=argparse.SUPPRESS)  # the default
    ray_down.add_argument("--run-dir", help="The run's directory (default runs/RUN).")
    ray_down.add_argument(
        "--run",
        help="The run (default: topics.prefix without its dot; --ray without it: every run).",
    )
    ray_down.add_argument(
        "--grace",
        type=float,
        default=STOP_GRACE_S,
        help=f"Seconds before SIGKILL (--ray; default {STOP_GRACE_S:.0f}: longer than a replica "
        "gives vLLM to stop). Without --ray: how long to wait for the run's own stop.",
    )
    ray_down.set_defaults(handler=cmd_down)
