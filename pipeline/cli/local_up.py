"""`rollout up` and `rollout down` without `--ray`: the pipeline on this machine.

`up` is the demo for a user's own data. Before any stage starts it checks the model
directories, asks the broker, refuses a run whose checkpoints are already at `--steps`
(one line, exit 1) and says how many steps the prompts waiting on the topic allow. Then it
runs in the foreground (`pipeline.launch.foreground`): one JSON line per process on stdout
(stage, pid, log; replicas with their address), the live table on a terminal or one line per
trainer step on stderr (`pipeline.observe.watch`), and once the trainer reaches
`trainer.max_steps` (`--steps`), the report in `RUN_DIR/report/` (`report.png`, the summary)
and the trainer's exit status. Ctrl-C or SIGTERM stops every stage it started (exit 130).

A run is named after its topics (`--run`, default `topics.prefix` without its trailing dot)
and keeps what is its own in `RUN_DIR` (`--run-dir`, default `runs/RUN` in the current
directory): `config.yaml`, `logs/`, `checkpoints/`, `report/`. The same prefix again is the
same run, which resumes; another prefix is another run, with its own consumer groups,
changelogs and checkpoints. `down [--run-dir DIR | --run NAME]` sends that SIGTERM from
another shell and waits for the run to stop.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.cli.common import checked_model_dir, failed, print_json
from pipeline.config import ConfigError, RunConfig

__all__ = [
    "cmd_down_local",
    "cmd_up_local",
    "resolved_models",
    "resumed_version",
    "run_dir_of",
    "run_name_of",
    "with_run_dir",
]


def resolved_models(args: argparse.Namespace, cfg: RunConfig) -> tuple[RunConfig, str]:
    """The run's config with `trainer.model_dir` (and `--steps`), the judge's model as
    absolute paths, and the policy's model directory; `--model` is also the tokenizer of the
    reward stage unless `reward.tokenizer` names another."""
    model = args.model or cfg.trainer.model_dir or cfg.agent_loop.model
    if not model:
        raise ConfigError("--model (or trainer.model_dir) must name the model directory")
    model = str(Path(checked_model_dir(model, "--model" if args.model else "model")).resolve())
    trainer: dict[str, Any] = {"model_dir": cfg.trainer.model_dir or model}
    if args.steps is not None:
        trainer["max_steps"] = args.steps
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=trainer)})
    reward = cfg.reward
    if reward.tokenizer is None and reward.scorer_kind != "reward_model":
        reward = reward.model_copy(update={"tokenizer": model})
    judge = reward.judge
    if judge.enable and judge.model:
        where = str(Path(checked_model_dir(judge.model, "reward.judge.model")).resolve())
        reward = reward.model_copy(update={"judge": judge.model_copy(update={"model": where})})
    return cfg.model_copy(update={"reward": reward}), model


def stages_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The stages `up` starts: all, or all but the trainer (`--no-trainer`)."""
    from pipeline.launch.local import STAGES

    return tuple(s for s in STAGES if not (args.no_trainer and s == "train"))


def run_name_of(args: argparse.Namespace, cfg: RunConfig) -> str:
    """`--run`, else the run the topics belong to (`topics.prefix` without its dot)."""
    return str(args.run or cfg.topics.run_name)


def run_dir_of(args: argparse.Namespace, cfg: RunConfig) -> Path:
    return Path(args.run_dir or f"runs/{run_name_of(args, cfg)}").resolve()


def with_run_dir(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """The trainer's checkpoints in `run_dir/checkpoints`, unless the config names another
    place (then that place, as an absolute path)."""
    trainer = cfg.trainer
    derived = str(Path("runs") / cfg.topics.run_name / "checkpoints")
    where = run_dir / "checkpoints" if trainer.checkpoint_dir == derived else trainer.checkpoint_dir
    update: dict[str, Any] = {"checkpoint_dir": str(Path(where).resolve())}
    if trainer.metrics_file:
        update["metrics_file"] = str(Path(trainer.metrics_file).resolve())
    # The stateful stages' counters (what they dropped as already done), for the run's view.
    stats = {
        section: getattr(cfg, section).model_copy(
            update={"stats_path": str(run_dir / "stats" / f"{section}.json")}
        )
        for section in ("reward", "replay")
        if getattr(cfg, section).stats_path is None
    }
    if stats:
        (run_dir / "stats").mkdir(parents=True, exist_ok=True)
    return cfg.model_copy(update={"trainer": trainer.model_copy(update=update), **stats})


def resumed_version(cfg: RunConfig) -> int:
    """The version the run's trainer resumes at (0: a new run); a run already at
    `trainer.max_steps` is refused here, before any stage starts."""
    from workers.trainer.exceptions import RunFinishedError
    from workers.weights.checkpoint import load_latest

    ckpt = load_latest(cfg.trainer.checkpoint_dir)
    if ckpt is None:
        return 0
    limit = cfg.trainer.max_steps
    if limit is not None and ckpt.state.version >= limit:
        raise RunFinishedError(
            f"run {cfg.topics.run_name} is done: {ckpt.path} is at version "
            f"{ckpt.state.version}, --steps is {limit}; --steps above {ckpt.state.version} "
            "continues it, another topics.prefix (--set topics.prefix=NAME.) starts a new run"
        )
    print(f"rollout: resuming from {ckpt.path} (version {ckpt.state.version})", file=sys.stderr)
    return int(ckpt.state.version)


def cmd_up_local(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.launch.foreground import run_foreground
    from pipeline.launch.local import LocalPipeline
    from pipeline.observe.watch import RunWatch, data_outlook
    from pipeline.topics import require_topics

    cfg, model = resolved_models(args, cfg)
    run, run_dir = run_name_of(args, cfg), run_dir_of(args, cfg)
    cfg = with_run_dir(cfg, run_dir)
    version = 0 if args.no_trainer else resumed_version(cfg)
    if args.no_trainer:
        print(
            "rollout: no trainer (--no-trainer): up runs until Ctrl-C or `rollout down`; "
            "your trainer publishes with pipeline.clients.PolicyPublisher",
            file=sys.stderr,
        )
    elif cfg.trainer.max_steps is None:
        print("rollout: the trainer has no max_steps (--steps): up runs until Ctrl-C",
              file=sys.stderr)  # fmt: skip
    # An unreachable broker or a missing topic: one line now, not five stage logs.
    for name, outcome in require_topics(cfg.kafka, cfg.topics, ["prompts"]).items():
        print(f"{name}\t{outcome}", file=sys.stderr)
    for line in data_outlook(cfg, version).lines():
        print(f"rollout: {line}", file=sys.stderr)
    if args.backend == "hf" and (args.tp, args.dp, args.pp) != (1, 1, 1):
        raise ConfigError("the hf backend runs on CPU: it takes no --tp/--dp/--pp")
    gpus = None
    if args.gpus is not None:
        from pipeline.launch.devices import visible_gpus

        gpus = visible_gpus(args.gpus)
    watch: RunWatch | None = None

    def started(pipe: LocalPipeline) -> None:
        nonlocal watch
        addresses = {f"replica-{i}": url for i, url in enumerate(pipe.replica_urls)}
        addresses |= {f"judge-{i}": url for i, url in enumerate(pipe.judge_urls)}
        for name, row in pipe.summary().items():
            print_json({"stage": name, "pid": row["pid"], "log": row["log"]}
                       | ({"address": addresses[name]} if name in addresses else {}))  # fmt: skip
        sys.stdout.flush()
        print(
            f"rollout: run {run} is up (logs: {run_dir / 'logs'}); it stops when the "
            f"trainer is done, or on Ctrl-C / `rollout down --run-dir {run_dir}`",
            file=sys.stderr,
        )
        watch = RunWatch(cfg, pipe.replica_urls, title=f"rollout up {run}")

    began = time.monotonic()
    try:
        code = run_foreground(
            cfg,
            run_dir,
            replicas=args.replicas,
            timeout_s=args.timeout,
            on_started=started,
            on_poll=lambda: watch.poll() if watch is not None else None,
            model_dir=model,
            backend=args.backend,
            replica_threads=args.replica_threads,
            agent_loop_workers=args.agent_loop_workers,
            parallel=(args.tp, args.dp, args.pp),
            stages=stages_of(args),
            gpus=gpus,
            grace_s=args.grace,
        )
    finally:
        if watch is not None:
            watch.close()
    print(f"{run}/train exited with {code}; every stage stopped", file=sys.stderr)
    if watch is not None and code == 0:
        info = {
            "bootstrap": cfg.kafka.bootstrap,
            "topics_prefix": cfg.topics.prefix,
            "topics": cfg.topics.all_names(),
            "run_dir": str(run_dir),
            "replay": [
                f"rollout --bootstrap {cfg.kafka.bootstrap} --set topics.prefix="
                f"{cfg.topics.prefix} consume --topic {role}{' --decode' if decodes else ''}"
                for role, decodes in (("scored", True), ("replay", False), ("policy", False))
            ],
            "notes": [f"stage logs: {run_dir / 'logs'}, checkpoints: "
                      f"{cfg.trainer.checkpoint_dir}"],
        }  # fmt: skip
        out = run_dir / "report"
        sys.stderr.write(watch.report(out, wall_s=time.monotonic() - began, info=info))
        print(f"rollout: report: {out / 'report.png'}", file=sys.stderr)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def cmd_down_local(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.launch.foreground import running, stop_foreground

    run_dir = run_dir_of(args, cfg)
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
