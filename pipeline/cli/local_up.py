"""`rollout up` without `--ray` and `rollout down --local`: the pipeline on this machine.

`up` runs in the foreground (`pipeline.launch.foreground`): it prints one JSON line per
process (stage, pid, log; replicas with their address), says on stderr where the logs are,
and returns the trainer's exit status once it reaches `trainer.max_steps` (`--steps`). Ctrl-C
or SIGTERM stops every stage it started (exit 130). `down --local [--run-dir DIR | --run
NAME]` sends that SIGTERM from another shell and waits for the run to stop. The model
directories are checked, and the broker asked, before any stage starts: a wrong path or an
unreachable broker is one line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.cli.common import checked_model_dir, failed, print_json
from pipeline.config import ConfigError, RunConfig

__all__ = ["cmd_down_local", "cmd_up_local", "resolved_models", "run_dir_of"]


def resolved_models(args: argparse.Namespace, cfg: RunConfig) -> tuple[RunConfig, str]:
    """The run's config with `trainer.model_dir` (and `--steps`), the judge's model as
    absolute paths (the stages start in the checkout), and the policy's model directory."""
    model = args.model or cfg.trainer.model_dir or cfg.agent_loop.model
    if not model:
        raise ConfigError("--model (or trainer.model_dir) must name the model directory")
    model = str(Path(checked_model_dir(model, "--model" if args.model else "model")).resolve())
    trainer: dict[str, Any] = {"model_dir": cfg.trainer.model_dir or model}
    if args.steps is not None:
        trainer["max_steps"] = args.steps
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=trainer)})
    judge = cfg.reward.judge
    if judge.enable and judge.model:
        where = str(Path(checked_model_dir(judge.model, "reward.judge.model")).resolve())
        judge = judge.model_copy(update={"model": where})
        cfg = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"judge": judge})})
    return cfg, model


def run_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.run_dir or f"runs/{args.run or 'default'}").resolve()


def cmd_up_local(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.launch.foreground import run_foreground
    from pipeline.launch.local import LocalPipeline
    from workers.kafka.clients import make_admin

    cfg, model = resolved_models(args, cfg)
    if cfg.trainer.max_steps is None:
        print("rollout: the trainer has no max_steps (--steps): up runs until Ctrl-C",
              file=sys.stderr)  # fmt: skip
    make_admin(cfg.kafka).close()  # an unreachable broker: one line now, not five stage logs
    run_dir = run_dir_of(args)
    replica_args: tuple[str, ...] = ()
    if args.backend != "hf":
        sizes = zip(("--tp", "--dp", "--pp"), (args.tp, args.dp, args.pp), strict=True)
        replica_args = tuple(arg for flag, size in sizes for arg in (flag, str(size)))
    elif (args.tp, args.dp, args.pp) != (1, 1, 1):
        raise ConfigError("the hf backend runs on CPU: it takes no --tp/--dp/--pp")

    def started(pipe: LocalPipeline) -> None:
        addresses = {f"replica-{i}": url for i, url in enumerate(pipe.replica_urls)}
        addresses |= {f"judge-{i}": url for i, url in enumerate(pipe.judge_urls)}
        for name, row in pipe.summary().items():
            print_json({"stage": name, "pid": row["pid"], "log": row["log"]}
                       | ({"address": addresses[name]} if name in addresses else {}))  # fmt: skip
        sys.stdout.flush()
        print(
            f"rollout: run {args.run} is up (logs: {run_dir / 'logs'}); it stops when the "
            f"trainer is done, or on Ctrl-C / `rollout down --local --run-dir {run_dir}`",
            file=sys.stderr,
        )

    code = run_foreground(
        cfg,
        run_dir,
        replicas=args.replicas,
        timeout_s=args.timeout,
        on_started=started,
        model_dir=model,
        backend=args.backend,
        replica_threads=args.replica_threads,
        agent_loop_workers=args.agent_loop_workers,
        replica_args=replica_args,
    )
    print(f"{args.run}/train exited with {code}; every stage stopped", file=sys.stderr)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def cmd_down_local(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.launch.foreground import running, stop_foreground

    run_dir = run_dir_of(args)
    pid = stop_foreground(run_dir)
    if pid is None:
        return failed(f"no local run is up in {run_dir} (no live `rollout up` in its up.pid)")
    deadline = time.monotonic() + args.grace + 30  # its own grace, then SIGKILL and reaping
    while time.monotonic() < deadline:
        if not running(pid):
            print(f"{run_dir}\tstopped (pid {pid})")
            return 0
        time.sleep(0.2)
    return failed(f"rollout up (pid {pid}) still runs {args.grace + 30:.0f}s after SIGTERM")
