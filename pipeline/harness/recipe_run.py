"""One run of a recipe on the local pipeline: its config, model, prompts and stages.

What the demo runs, and `rollout bench learn` and `bench lend` run again and again (each
with its own seed, staleness bound or lending): `recipe_config` is the run's config for the
recipe under a prefix of its own, `prepare_model` builds the tiny model and gives it the
recipe's warm start, `produce_prompts` produces the recipe's arithmetic dataset, and
`train_stages` runs every stage as a process (`LocalPipeline`) with the live view until the
trainer has made the recipe's steps. The demo adds the broker, the console and the report.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.harness.local_run import merge
from pipeline.harness.models.tiny import MOE_PRESETS
from pipeline.harness.recipe import DemoRecipe

__all__ = [
    "DEADLINE_S",
    "MAX_STALENESS",
    "MOE_DEADLINE_S",
    "model_dir_in",
    "prepare_model",
    "produce_prompts",
    "recipe_config",
    "sigterm_as_interrupt",
    "train_stages",
]

MAX_STALENESS = 2
DEADLINE_S = 540.0  # stop training in time for teardown and the report within 10 minutes
# The moe preset: twice the warm-start steps (`PRESET_CHANGES`) of a model that takes ~2x the
# time per token on a CPU; within 20 minutes.
MOE_DEADLINE_S = 1140.0


# vLLM replicas: fp32 like the trainer, started without torch.compile (a faster start).
VLLM_REPLICA_ARGS = ("--dtype", "float32", "--vllm-arg=--enforce-eager", "--vllm-arg=-O0")
VLLM_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def model_dir_in(run_dir: Path) -> Path:
    """Where a demo run keeps its model: initialised, warm-started, served and trained there."""
    return run_dir / "model"


def recipe_config(
    cfg: RunConfig,
    *,
    prefix: str,
    run_dir: Path,
    recipe: DemoRecipe,
    max_staleness: int = MAX_STALENESS,
    backend: str = "hf",
) -> RunConfig:
    """`cfg` (Kafka settings kept) with every stage configured for the demo's recipe."""
    model_dir = model_dir_in(run_dir)
    data = cfg.model_dump()
    updates: dict[str, dict[str, Any]] = {
        "topics": {"prefix": prefix},
        "agent_loop": {
            "group_id": f"{prefix}agent-loop",
            "model": str(model_dir),
            "n": recipe.n,
            "max_samples_in_flight": 64,
            "commit_interval_s": 0.5,
            "sampling": {"max_tokens": recipe.max_tokens, "temperature": 1.0},
            # vLLM needs a minute or two to become healthy on a CPU; hf replicas seconds, or
            # as long as the trainer takes to start with broadcast weights (they wait for it).
            "llm": {
                "health_interval_s": 1.0,
                "no_replica_wait_s": 600.0
                if backend == "vllm" or cfg.weights.mode == "broadcast"
                else 30.0,
            },
        },
        "reward": {
            "group_id": f"{prefix}reward",
            "tokenizer": str(model_dir),
            "batch_within_s": 0.1,
            "commit_interval_s": 0.5,
            "overlong": {
                "buffer_len": recipe.overlong_buffer,
                "penalty_factor": recipe.overlong_penalty,
            },
        },
        "replay": {
            "group_id": f"{prefix}replay",
            "n": recipe.n,
            "drop_zero_variance": recipe.drop_zero_variance,
            "batch_within_s": 0.1,
            "commit_interval_s": 0.5,
        },
        "trainer": {
            "model_dir": str(model_dir),
            "checkpoint_dir": str(run_dir / "checkpoints"),
            "group_id": f"{prefix}trainer",
            "micro_batch_size": recipe.train_batch_size * recipe.n,
            "sync_every": 1,
            "max_steps": recipe.steps,
            "max_staleness": max_staleness,  # the replay stage and the gate derive theirs
            "torch_threads": 1,
            "seed": recipe.seed,
            # A MoE policy trains through the experts the rollout chose (the replicas return
            # them: the agent loop asks a MoE model for its routing by default).
            "router_replay": "r3" if recipe.preset in MOE_PRESETS else "off",
            **recipe.trainer_settings(),
        },
    }
    for section, values in updates.items():
        data[section] = merge(data.get(section, {}), values)
    return RunConfig(**data)


def prepare_model(
    model_dir: Path, recipe: DemoRecipe, done: dict[str, Any], cancel: threading.Event
) -> None:
    """Init + warm start (run in a thread while the broker starts); result or error in `done`."""
    try:
        import torch
        from transformers.utils import logging as hf_logging

        from pipeline.harness.recipe import warm_model

        hf_logging.disable_progress_bar()
        torch.set_num_threads(1)
        torch.manual_seed(recipe.seed)
        _, done["warm_start_s"] = warm_model(model_dir, recipe, cancel)
    except BaseException as exc:  # handed to the main thread, which re-raises it
        done["error"] = exc


def sigterm_as_interrupt() -> Any:
    """Make SIGTERM raise KeyboardInterrupt (so `with` blocks unwind); returns the old handler."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def produce_prompts(
    cfg: RunConfig,
    out: Path,
    recipe: DemoRecipe,
    prompts: int | None = None,
    *,
    max_staleness: int = MAX_STALENESS,
) -> int:
    """The dataset (jsonl next to the report) → the prompts topic; returns how many."""
    from pipeline.data.arithmetic import arithmetic_rows, write_rows
    from pipeline.data.producer import PromptProducer

    # Enough for every step, plus what the admission gate lets run ahead of the trainer.
    count = prompts or (recipe.steps + max_staleness + 3) * recipe.train_batch_size
    if recipe.drop_zero_variance and prompts is None:
        count *= 4  # groups whose samples all score alike never reach the trainer
    rows = arithmetic_rows(count, seed=recipe.seed + 1, max_operand=recipe.max_operand)
    dataset = write_rows(rows, out / "prompts.jsonl")
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        report = producer.produce_file(dataset)
    return report.sent


def train_stages(
    cfg: RunConfig,
    run_dir: Path,
    recipe: DemoRecipe,
    console: Any,
    started: float,
    *,
    deadline_s: float = DEADLINE_S,
    backend: str = "hf",
) -> tuple[list[dict[str, Any]], float]:
    """Every stage as a process, the live view (on `console`) until the trainer is done.

    Returns the trainer's step records and the (epoch) time the stages were launched.
    """
    from rich.live import Live

    from pipeline.launch.local import LocalPipeline
    from pipeline.observe.progress import Progress, StageSpec, render

    t = cfg.topics.name
    specs = [
        StageSpec("agent-loop", cfg.agent_loop.group_id, t("prompts"), (t("turns"),)),
        StageSpec("reward", cfg.reward.group_id, t("turns"), (t("scored"),)),
        StageSpec("replay", cfg.replay.group_id, t("scored"), (t("replay"), t("stale")), recipe.n),
        StageSpec("trainer", cfg.trainer.group_id, t("replay"), (t("policy"),)),
    ]
    metrics = Path(cfg.trainer.metrics_path)
    launched = time.time()
    vllm = backend == "vllm"
    with LocalPipeline(
        cfg,
        run_dir,
        model_dir=str(model_dir_in(run_dir)),
        replicas=2,
        backend=backend,
        replica_args=VLLM_REPLICA_ARGS if vllm else (),
        extra_env={k: os.environ.get(k, v) for k, v in VLLM_ENV_DEFAULTS.items()} if vllm else None,
    ) as pipe:
        progress = Progress(cfg.kafka, specs, pipe.replica_urls, metrics)
        trainer = pipe.process("train")
        try:
            with Live(console=console, refresh_per_second=2, transient=False) as live:
                while trainer.alive and time.monotonic() - started < deadline_s:
                    for stage in pipe.processes:
                        if stage is not trainer and not stage.alive:
                            pipe.check()
                    snap = progress.poll()
                    elapsed = time.monotonic() - started
                    live.update(
                        render(
                            snap,
                            max_steps=recipe.steps,
                            elapsed_s=elapsed,
                            title=f"rollout demo {cfg.topics.prefix}",
                        )
                    )
                    time.sleep(1.0)
                snap = progress.poll()
                live.update(
                    render(
                        snap,
                        max_steps=recipe.steps,
                        elapsed_s=time.monotonic() - started,
                        title=f"rollout demo {cfg.topics.prefix}",
                    )
                )
            if trainer.alive:
                console.print(f"deadline reached after {snap.step} steps; stopping")
            elif trainer.proc is not None and trainer.proc.returncode != 0:
                raise RuntimeError(
                    f"trainer exited with {trainer.proc.returncode}:\n{trainer.tail()}"
                )
        finally:
            progress.close()
            console.print("\nstopping the stages…")
    from workers.trainer.steplog import effective_steps

    steps = list(effective_steps(metrics).values()) if metrics.exists() else []
    return steps, launched
