"""`rollout bench lend`: the demo's pipeline to the same step, the idle trainer lent or not.

The demo's whole pipeline (`pipeline.harness.demo.run`: warm-started tiny model, Kafka, agent loop,
reward, replay, trainer, weight sync) runs twice from the same warm-started model, prompts and
seed, on one broker: with `trainer.lend` off, then on. One standalone `hf` replica; the
trainer and that replica are each pinned to one core (`os.sched_setaffinity`, right after
they start, so the threads they create inherit it), as two pools of GPUs would be: with
generation slower than training the trainer idles, and lending puts that idle core to work.

Figures per side: `wall_s` (stages launched → the last step), `trainer_idle_share` (1 − the
steps' summed `step_time_s` over the trainer's time from its start record to its last step),
`reward first/last/delta` and `learned` (`pipeline.harness.bench.learn.summarize_run`), `affinity`
(the CPU lists the trainer's and the replica's threads may run on, read after the first step:
one entry each shows the pinning held for every thread). With lending
on also `lent_share`: the pieces the lent engine finished (not aborted) over the samples
trained, and the lend counters of the last step (`lends`, `declined`: collections that found
their groups already waiting and did not lend, `withdrawals`, `tokens_during_steps`, which
must be 0). `ratio` = `wall_s` off / on (> 1: lending made the run faster); the baseline is
the run without lending, measured in the same invocation. `ignore_eos` 1: every response
runs to `max_tokens` (the demo's answers end in a few tokens), so generation dominates a step.
`max_staleness` (the demo's 2 by default): 0 makes the run synchronous (no generation runs
ahead of the trainer), so the trainer idles for the whole generation of each batch.
`max_batch` (0: the engines' own, 64): the rows each engine decodes at once, the replica's
`--max-batch` and `trainer.lend.max_batch` alike. Below a batch's requests it makes generation
throughput-bound, as engines whose KV cache is full are on GPUs: the tiny model on one core
decodes 32 rows in about the time of 64, so with every request running at once a second engine
barely shortens a batch, while with `max_batch` 16 each engine works through its share in
waves and a second engine halves the waves.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.harness.bench.common import bench_broker
from workers.kafka.config import KafkaConfig

__all__ = ["run"]


def _pin(pid: int | None, core: int | None) -> None:
    if pid is not None and core is not None:
        try:
            os.sched_setaffinity(pid, {core})
        except OSError:  # the process already exited: the run reports it
            pass


def _affinity(pid: int | None) -> list[str]:
    """The distinct CPU lists the threads of `pid` may run on (one entry: every thread pinned
    alike); read while the process runs, so the figure shows the pinning held."""
    if pid is None:
        return []
    lists = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:  # the thread ended
            continue
        lists.update(line.split(":", 1)[1].strip() for line in lines if "Cpus_allowed_list" in line)
    return sorted(lists)


def _records(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def _side(
    kafka: KafkaConfig,
    model: Path,
    out: Path,
    recipe: Any,
    *,
    lend: bool,
    reclaim_ratio: float,
    ignore_eos: bool,
    max_staleness: int,
    max_batch: int,
    cores: tuple[int | None, int | None],
    deadline_s: float,
) -> dict[str, Any]:
    from pipeline.config import RunConfig
    from pipeline.harness.bench.learn import summarize_run
    from pipeline.harness.local_run import merge
    from pipeline.harness.recipe_run import model_dir_in, produce_prompts, recipe_config
    from pipeline.launch.local import LocalPipeline
    from pipeline.topics import create_topics, delete_topics
    from workers.trainer.steplog import effective_steps

    name = "on" if lend else "off"
    run_dir = out / name
    shutil.copytree(model, model_dir_in(run_dir))
    prefix = f"lend-{name}-{int(time.time() * 1000) % 10**9}."
    cfg = recipe_config(
        RunConfig(kafka=kafka),
        prefix=prefix,
        run_dir=run_dir,
        recipe=recipe,
        max_staleness=max_staleness,
    )
    data = cfg.model_dump()
    lending: dict[str, Any] = {"enable": lend, "reclaim_ratio": reclaim_ratio}
    if max_batch:
        lending["max_batch"] = max_batch
    data["trainer"] = merge(data["trainer"], {"lend": lending})
    # Every response to max_tokens: generation, not the trainer, sets the pace.
    data["agent_loop"]["sampling"]["ignore_eos"] = ignore_eos
    cfg = RunConfig(**data)
    create_topics(cfg.kafka, cfg.topics)
    metrics = Path(cfg.trainer.metrics_path)
    try:
        produce_prompts(cfg, run_dir, recipe, max_staleness=max_staleness)
        launched = time.time()
        with LocalPipeline(
            cfg,
            run_dir,
            model_dir=str(model_dir_in(run_dir)),
            replicas=1,
            replica_args=("--max-batch", str(max_batch)) if max_batch else (),
        ) as pipe:
            trainer = pipe.process("train")
            _pin(trainer.proc.pid if trainer.proc else None, cores[0])
            replica = next(p for p in pipe.processes if p.name.startswith("replica"))
            _pin(replica.proc.pid if replica.proc else None, cores[1])
            deadline = time.monotonic() + deadline_s
            affinity: dict[str, list[str]] = {}
            while trainer.alive and time.monotonic() < deadline:
                if not affinity and any(r.get("event") == "step" for r in _records(metrics)):
                    # once the trainer stepped: its threads and the replica's all exist
                    affinity = {
                        "trainer": _affinity(trainer.proc.pid if trainer.proc else None),
                        "replica": _affinity(replica.proc.pid if replica.proc else None),
                    }
                for stage in pipe.processes:
                    if stage is not trainer and not stage.alive:
                        pipe.check()
                time.sleep(0.5)
            if trainer.proc is not None and trainer.proc.poll() not in (0, None):
                raise RuntimeError(f"trainer exited with {trainer.proc.returncode}")
    finally:
        delete_topics(cfg.kafka, cfg.topics)
    steps = list(effective_steps(metrics).values()) if metrics.exists() else []
    rows = _records(metrics)
    summary = summarize_run(steps, launched)
    start = min((r["time"] for r in rows if r.get("event") == "start"), default=launched)
    busy = sum(float(r.get("step_time_s", 0.0)) for r in steps)
    span = (float(steps[-1]["time"]) - start) if steps else float("nan")
    result: dict[str, Any] = {
        "lend": lend,
        "steps": summary["steps"],
        "wall_s": round(summary["wall_s"], 2),
        "trainer_idle_share": round(1.0 - busy / span, 3) if span and span > 0 else None,
        "reward_first": round(summary["first"], 3),
        "reward_last": round(summary["last"], 3),
        "delta": round(summary["delta"], 3),
        "learned": summary["learned"],
        "affinity": affinity,
    }
    lends = [r for r in rows if r.get("event") == "lend"]
    if lends:
        last = lends[-1]
        samples = sum(int(r["samples"]) for r in steps)
        result.update(
            lent_share=round(last["finished"] / samples, 3) if samples else None,
            lent_finished=last["finished"],
            lent_completions=last["completions"],
            lends=last["lends"],
            declined=last.get("declined", 0),
            withdrawals=last["withdrawals"],
            tokens_during_steps=last["tokens_during_steps"],
            running_at_steps=last["running_at_steps"],
        )
    return result


def run(
    kafka: KafkaConfig,
    *,
    steps: int = 20,
    seed: int = 0,
    max_tokens: int = 16,
    reclaim_ratio: float = 0.75,
    ignore_eos: int = 0,
    max_staleness: int = 2,
    max_batch: int = 0,
    deadline_s: float = 1200.0,
) -> dict[str, Any]:
    from dataclasses import replace

    from pipeline.harness.recipe import DemoRecipe
    from pipeline.harness.recipe_run import prepare_model

    recipe = replace(DemoRecipe(), seed=seed, steps=steps, max_tokens=max_tokens)
    usable = sorted(os.sched_getaffinity(0))
    # Two cores: trainer on the first, the replica on the second (one core: not pinned).
    cores: tuple[int | None, int | None] = (
        (usable[0], usable[1]) if len(usable) >= 2 else (None, None)
    )
    with bench_broker(kafka) as kafka_cfg, tempfile.TemporaryDirectory(prefix="rollout-lend-") as t:
        tmp = Path(t)
        prepared: dict[str, Any] = {}
        prepare_model(tmp / "model", recipe, prepared, threading.Event())
        if "error" in prepared:
            raise prepared["error"]
        sides = {
            lend: _side(
                kafka_cfg,
                tmp / "model",
                tmp,
                recipe,
                lend=lend,
                reclaim_ratio=reclaim_ratio,
                ignore_eos=bool(ignore_eos),
                max_staleness=max_staleness,
                max_batch=max_batch,
                cores=cores,
                deadline_s=deadline_s,
            )
            for lend in (False, True)
        }
    off, on = sides[False], sides[True]
    return {
        "benchmark": "lend",
        "steps": steps,
        "seed": seed,
        "max_tokens": max_tokens,
        "reclaim_ratio": reclaim_ratio,
        "ignore_eos": bool(ignore_eos),
        "max_staleness": max_staleness,
        "max_batch": max_batch,
        "pinned_cores": {"trainer": cores[0], "replica": cores[1]},
        "wall_s_off": off["wall_s"],
        "wall_s_on": on["wall_s"],
        "ratio": round(off["wall_s"] / on["wall_s"], 3) if on["wall_s"] else None,
        "trainer_idle_share_off": off["trainer_idle_share"],
        "trainer_idle_share_on": on["trainer_idle_share"],
        "lent_share": on.get("lent_share"),
        "affinity": {"off": off["affinity"], "on": on["affinity"]},
        "learned_off": off["learned"],
        "learned_on": on["learned"],
        "runs": {"off": off, "on": on},
    }
