"""`make demo` / `rollout demo`: the whole pipeline learns arithmetic on a local broker.

What it does, in order (each step's output lives under `reports/demo-<stamp>/`):

1. Starts the local Kafka broker, unless the run names one (`--bootstrap`, config, env), and
   creates the topics under a prefix of this run's own (`demo-<stamp>.`). While the broker
   starts, it builds the tiny policy model and gives it the short supervised warm start of
   `pipeline.demo.recipe` (the reward then starts well above 0 and well below 1).
2. Produces a generated arithmetic dataset in gsm8k format (`#### answer`) to the prompts topic.
3. Starts two replicas (`hf`, or `vllm` with `--backend vllm`: vLLM on the CPU from
   .venv-vllm, fp32, weights synced through it the same way; each replica with its
   weight-sync controller), the agent-loop worker,
   the reward worker, the replay stage and the trainer, every one its own process
   (`pipeline.launch.local.LocalPipeline`), and shows one live line per stage
   (`pipeline.observe.progress`).
4. Stops when the trainer has made `steps` steps (`trainer.max_steps`), or at the deadline.
5. Tears everything down — the stages, then the broker if the demo started it — also on
   Ctrl-C or SIGTERM, and writes the report (`pipeline.observe.report`): `report.png`,
   `metrics.csv`/`.json`, `summary.json`/`.txt`. It prints the reward over the first and
   last 10% of steps, the summary, and the report directory as its very last line.

The topics are kept (a local broker keeps them in its data directory), so the summary says
how to replay any of them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, load_config
from pipeline.demo.recipe import DemoRecipe
from pipeline.launch.local_run import merge
from workers.llm.model_init import MOE_PRESETS

__all__ = [
    "demo_config",
    "prepare_model",
    "produce_prompts",
    "run_demo",
    "sigterm_as_interrupt",
    "train_stages",
]

log = logging.getLogger("rollout.demo")

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


def demo_config(
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

        from pipeline.demo.recipe import warm_model

        hf_logging.disable_progress_bar()
        torch.set_num_threads(1)
        torch.manual_seed(recipe.seed)
        _, done["warm_start_s"] = warm_model(model_dir, recipe, cancel)
    except BaseException as exc:  # handed to the main thread, which re-raises it
        done["error"] = exc


class _Deferred:
    """Hold Ctrl-C / SIGTERM back while the block runs; raise KeyboardInterrupt after it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> _Deferred:
        self.caught: int | None = None
        self.saved = {
            sig: signal.signal(sig, self._hold)
            for sig in self.SIGNALS
            if signal.getsignal(sig) is not signal.SIG_IGN  # ignored stays ignored
        }
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        self.caught = signum

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        if self.caught is not None and exc_type is None:
            raise KeyboardInterrupt(f"signal {self.caught}")


def sigterm_as_interrupt() -> Any:
    """Make SIGTERM raise KeyboardInterrupt (so `with` blocks unwind); returns the old handler."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def run_demo(
    cfg: RunConfig,
    *,
    steps: int | None = None,
    prompts: int | None = None,
    out_root: str = "reports",
    recipe: DemoRecipe | None = None,
    backend: str = "hf",
) -> Path:
    """Run the demo of the module docstring; returns the report directory."""
    from rich.console import Console

    from pipeline.broker.local import start_broker, stop_broker
    from pipeline.topics import create_topics
    from workers.kafka.clients import make_admin

    recipe = recipe or DemoRecipe()
    if steps is not None:
        recipe = DemoRecipe(**{**recipe.__dict__, "steps": steps})
    console = Console(stderr=True)
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(out_root).resolve() / f"demo-{stamp}"
    run_dir = out / "run"
    model_dir = model_dir_in(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"demo-{stamp}."
    previous_handler = sigterm_as_interrupt()
    started_port: int | None = None
    broker_note = ""
    prepared: dict[str, Any] = {}
    cancel = threading.Event()
    worker: threading.Thread | None = None
    try:
        if "bootstrap_servers" in cfg.kafka.model_fields_set:
            # A named broker that does not answer is one line now; the model work below
            # cannot be cancelled halfway.
            make_admin(cfg.kafka).close()
        worker = threading.Thread(
            target=prepare_model, args=(model_dir, recipe, prepared, cancel), daemon=True
        )
        worker.start()
        state = None
        if "bootstrap_servers" not in cfg.kafka.model_fields_set:  # none named: our own
            # An interrupt inside start_broker would leave a JVM running that nobody stops:
            # hold it back until the broker's port is known, so `finally` can stop it.
            with _Deferred():
                local = cfg.local_kafka
                state = start_broker(local.port, local.data_dir, heap=local.heap, quiet=True)
                if not state.reused:
                    started_port = state.port
        if state is not None:
            if state.data_dir:
                broker_note = (
                    f"local broker data: {state.data_dir} (start it again: "
                    f"rollout kafka up --port {state.port} --data-dir {state.data_dir})"
                )
            kafka = cfg.kafka.model_copy(update={"bootstrap_servers": [state.bootstrap]})
            cfg = cfg.model_copy(update={"kafka": kafka})
        console.print(f"Kafka at {cfg.kafka.bootstrap} ({time.monotonic() - started:.0f}s)")
        worker.join()
        if "error" in prepared:
            raise prepared["error"]
        console.print(
            f"model {recipe.preset} + warm start ({recipe.sft_steps} SFT steps, "
            f"{prepared['warm_start_s']:.0f}s) in {model_dir}"
        )
        cfg = demo_config(cfg, prefix=prefix, run_dir=run_dir, recipe=recipe, backend=backend)
        created = create_topics(cfg.kafka, cfg.topics)
        console.print(f"topics: {', '.join(created)}")
        sent = produce_prompts(cfg, out, recipe, prompts)
        console.print(f"produced {sent} prompts to {cfg.topics.name('prompts')}")
        deadline = MOE_DEADLINE_S if recipe.preset in MOE_PRESETS else DEADLINE_S
        steps_done, launched = train_stages(
            cfg, run_dir, recipe, console, started, deadline_s=deadline, backend=backend
        )
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        if worker is not None and worker.is_alive():
            cancel.set()  # torch must not be mid-step when the interpreter exits
            worker.join(timeout=30)
        if started_port is not None:
            stop_broker(started_port)
            console.print(f"stopped the local broker on port {started_port}")
    wall_s = time.monotonic() - started
    _report(out, cfg, steps_done, wall_s, broker_note, launched)
    print(out)
    return out


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


def _report(
    out: Path,
    cfg: RunConfig,
    steps: list[dict[str, Any]],
    wall_s: float,
    broker_note: str,
    launched: float,
) -> None:
    from pipeline.observe.report import write_report

    bootstrap, prefix = cfg.kafka.bootstrap, cfg.topics.prefix
    info = {
        "bootstrap": bootstrap,
        "topics_prefix": prefix,
        "topics": cfg.topics.all_names(),
        "run_dir": str(out / "run"),
        "replay": [
            f"rollout --bootstrap {bootstrap} --set topics.prefix={prefix} consume --topic {role}"
            for role in ("prompts", "turns", "scored", "replay", "policy")
        ],
        "notes": [n for n in (broker_note,) if n]
        + [f"stage logs: {out / 'run' / 'logs'}, step log: {cfg.trainer.metrics_path}"],
    }
    summary = write_report(out, steps, wall_s=wall_s, info=info, started_at=launched)
    print(f"reward_first_10pct {summary['reward_first_10pct']:.3f}")
    print(f"reward_last_10pct {summary['reward_last_10pct']:.3f}")
    print((out / "summary.txt").read_text(), end="")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.demo")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument(
        "--preset",
        choices=["tiny", "moe"],
        default="tiny",
        help="The policy: tiny (dense Qwen2) or moe (Qwen3-MoE, trained with router_replay=r3).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.ERROR)  # retries on fresh topics are routine
    try:
        run_demo(load_config(), backend=args.backend, recipe=DemoRecipe.for_preset(args.preset))
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    return 0
