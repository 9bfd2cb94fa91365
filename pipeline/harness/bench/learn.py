"""`rollout bench learn`: does the demo's pipeline learn, run after run?

Runs the demo's whole pipeline (`pipeline.harness.demo.run`: replicas, Kafka, agent loop, reward,
replay, trainer, weight sync; no live view) `runs` times with distinct seeds (seed i builds
its own model, warm start and prompts, and seeds the trainer), at each requested
`max_staleness` η, one run after another on one broker, and reads each run's step log.

Per run: `first`/`last`, the mean reward over the first and last 10% of steps; `delta`;
`learned` (delta ≥ 0.2); `collapsed` (last below first, or below 0.05); `wall_s` (stages
launched → last step); `time_to_reward_s`, the seconds from launch until the mean reward of
the last 5 steps first reaches 0.4 (None if never); and what explains a failure: the last
steps' truncated share and entropy, the largest behaviour KL and raw importance weight,
steps whose advantages were all 0, the mean clip fraction, the step time.

With several η, `time_to_reward_speedup` = mean time to reward at the smallest η / at the
largest: the honest form of an async speed-up (the same reward, in wall time), not time per
step. A run that never reaches the reward counts with its wall time (a lower bound), and
`time_to_reward_reached` says how many did.
"""

from __future__ import annotations

import io
import json
import math
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.harness.bench.common import bench_broker
from pipeline.harness.recipe import DemoRecipe

__all__ = ["learn_once", "run", "summarize_run"]

LEARNED = 0.2
COLLAPSED = 0.05
TARGET = 0.6
WINDOW = 5


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")


def summarize_run(
    steps: list[dict[str, Any]], launched: float, *, target: float = TARGET
) -> dict[str, Any]:
    """The figures of the module docstring for one run's step records."""
    steps = sorted(steps, key=lambda r: int(r["step"]))
    rewards = [float(r["reward_mean"]) for r in steps]
    k = max(1, math.ceil(len(rewards) / 10)) if rewards else 0
    first, last = _mean(rewards[:k]), _mean(rewards[-k:])
    reached = None
    for i in range(WINDOW - 1, len(steps)):
        if _mean(rewards[i - WINDOW + 1 : i + 1]) >= target:
            reached = float(steps[i]["time"]) - launched
            break
    tail = steps[-k:] if k else []

    def worst(key: str) -> float:
        values = [float(r[key]) for r in steps if isinstance(r.get(key), int | float)]
        finite = [v for v in values if math.isfinite(v)]
        return max(finite) if finite else float("nan")

    delta = last - first
    return {
        "steps": len(steps),
        "first": first,
        "last": last,
        "delta": delta,
        "learned": bool(delta >= LEARNED),
        "collapsed": bool(not rewards or last < first or last < COLLAPSED),
        "wall_s": float(steps[-1]["time"]) - launched if steps else float("nan"),
        "time_to_reward_s": reached,
        "truncated_frac_last": _mean([float(r.get("truncated_frac", 0.0)) for r in tail]),
        "entropy_last": _mean([float(r.get("entropy", float("nan"))) for r in tail]),
        "behav_kl_max": worst("behav_kl"),
        "is_weight_raw_max": worst("is_weight_raw_max"),
        "zero_advantage_steps": int(sum(float(r.get("zero_advantage", 0.0)) for r in steps)),
        "pg_clipfrac_mean": _mean([float(r.get("pg_clipfrac", 0.0)) for r in steps]),
        "step_time_s_mean": _mean([float(r.get("step_time_s", float("nan"))) for r in steps]),
        "rewards": [round(r, 3) for r in rewards],
    }


def learn_once(
    cfg: RunConfig,
    recipe: DemoRecipe,
    out: Path,
    *,
    max_staleness: int,
    deadline_s: float,
    target: float = TARGET,
) -> dict[str, Any]:
    """One demo pipeline run into `out`; its `summarize_run` figures."""
    from rich.console import Console

    from pipeline.harness.recipe_run import (
        model_dir_in,
        prepare_model,
        produce_prompts,
        recipe_config,
        train_stages,
    )
    from pipeline.topics import create_topics, delete_topics

    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    prepared: dict[str, Any] = {}
    prepare_model(model_dir_in(run_dir), recipe, prepared, threading.Event())
    if "error" in prepared:
        raise prepared["error"]
    prefix = f"learn-{recipe.seed}-{max_staleness}-{int(time.time() * 1000) % 10**9}."
    cfg = recipe_config(
        cfg,
        prefix=prefix,
        run_dir=run_dir,
        recipe=recipe,
        max_staleness=max_staleness,
    )
    create_topics(cfg.kafka, cfg.topics)
    try:
        produce_prompts(cfg, out, recipe, max_staleness=max_staleness)
        quiet = Console(file=io.StringIO(), width=120)
        steps, launched = train_stages(
            cfg, run_dir, recipe, quiet, time.monotonic(), deadline_s=deadline_s
        )
    finally:
        delete_topics(cfg.kafka, cfg.topics)
    result = summarize_run(steps, launched, target=target)
    result.update(
        seed=recipe.seed, max_staleness=max_staleness, warm_start_s=prepared.get("warm_start_s")
    )
    return result


def _aggregate(results: list[dict[str, Any]]) -> dict[str, Any]:
    times = [
        r["time_to_reward_s"] if r["time_to_reward_s"] is not None else r["wall_s"] for r in results
    ]
    return {
        "runs": len(results),
        "learned": sum(r["learned"] for r in results),
        "collapsed": sum(r["collapsed"] for r in results),
        "deltas": [round(r["delta"], 3) for r in results],
        "wall_s": [round(r["wall_s"], 1) for r in results],
        "time_to_reward_s_mean": _mean(times),
        "time_to_reward_reached": sum(r["time_to_reward_s"] is not None for r in results),
        "step_time_s_mean": _mean([r["step_time_s_mean"] for r in results]),
    }


def run(
    cfg: RunConfig,
    *,
    runs: int,
    staleness: list[int],
    recipe: DemoRecipe | None = None,
    seed: int = 0,
    deadline_s: float = 540.0,
    target: float = TARGET,
    out_dir: str | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """`runs` seeds × each η of `staleness`; one JSON-able object (module docstring).

    SIGTERM is turned into KeyboardInterrupt while it runs, so a killed benchmark still stops
    every stage and the broker it started (the `with` blocks unwind)."""
    import signal

    from pipeline.harness.recipe_run import sigterm_as_interrupt

    base = recipe or DemoRecipe()
    results: dict[int, list[dict[str, Any]]] = {eta: [] for eta in staleness}
    started = time.monotonic()
    previous = sigterm_as_interrupt()
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-bench-learn-") as tmp:
            root = Path(out_dir) if out_dir else Path(tmp)
            with bench_broker(cfg.kafka) as kafka:
                cfg = cfg.model_copy(update={"kafka": kafka})
                for i in range(runs):
                    for eta in staleness:  # interleaved, so a slow spell hits every η alike
                        one = replace(base, seed=seed + i)
                        out = root / f"seed{one.seed}-eta{eta}"
                        result = learn_once(
                            cfg, one, out, max_staleness=eta, deadline_s=deadline_s, target=target
                        )
                        results[eta].append(result)
                        if progress is not None:
                            progress(result)
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary: dict[str, Any] = {"benchmark": "learn", "recipe": base.__dict__, "target": target}
    every = [r for eta in staleness for r in results[eta]]
    summary.update(_aggregate(every))
    summary["by_staleness"] = {str(eta): _aggregate(results[eta]) for eta in staleness}
    if len(staleness) > 1:
        low, high = min(staleness), max(staleness)
        t_low = summary["by_staleness"][str(low)]["time_to_reward_s_mean"]
        t_high = summary["by_staleness"][str(high)]["time_to_reward_s_mean"]
        summary["time_to_reward_speedup"] = t_low / t_high if t_high > 0 else float("nan")
    summary["per_run"] = every
    summary["bench_wall_s"] = time.monotonic() - started
    return json.loads(json.dumps(summary, default=float))
