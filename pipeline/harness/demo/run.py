"""`make demo` / `rollout demo`: the whole pipeline learns arithmetic on a local broker.

What it does, in order (each step's output lives under `reports/demo-<stamp>/`):

1. Starts the local Kafka broker, unless the run names one (`--bootstrap`, config, env), and
   creates the topics under a prefix of this run's own (`demo-<stamp>.`). While the broker
   starts, it builds the tiny policy model and gives it the short supervised warm start of
   `pipeline.harness.recipe` (the reward then starts well above 0 and well below 1).
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
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, load_config
from pipeline.harness.models.tiny import MOE_PRESETS
from pipeline.harness.recipe import DemoRecipe
from pipeline.harness.recipe_run import (
    DEADLINE_S,
    MOE_DEADLINE_S,
    model_dir_in,
    prepare_model,
    produce_prompts,
    recipe_config,
    sigterm_as_interrupt,
    train_stages,
)

__all__ = ["main", "run_demo"]

log = logging.getLogger("rollout.demo")


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
        cfg = recipe_config(cfg, prefix=prefix, run_dir=run_dir, recipe=recipe, backend=backend)
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

    parser = argparse.ArgumentParser(prog="python -m pipeline.harness.demo")
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
