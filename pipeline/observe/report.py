"""A run's report (`rollout up`, the demo): the trainer's step log turned into a plot, tables
and a summary.

`write_report(out_dir, steps, wall_s=..., info=...)` takes the trainer's `step` records
(`workers.trainer.steplog`: one per optimiser step, with `reward_mean`, `staleness_hist`,
`samples`, `time`, …) and writes into `out_dir`:

- `report.png`: reward mean per step (with a running mean), staleness (mean and max of the
  trained groups: trainer version − the version that generated them), throughput (samples
  trained per second since the previous step; for the first step since `started_at`, or
  NaN without it);
- `metrics.csv` / `metrics.json`: one row per step with those columns and the loss metrics;
- `summary.json`: at least `reward_first_10pct`, `reward_last_10pct`, `steps`, `wall_s`,
  plus everything in `info` (topics, bootstrap, how to replay);
- `summary.txt`: the same for a person.

The first/last 10% are the first and last `max(1, ceil(steps / 10))` steps. Pure Python
plus matplotlib (Agg backend), no Kafka, no torch: a unit test drives it with synthetic rows.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "step_rows", "summarize", "write_report"]

COLUMNS: tuple[str, ...] = (
    "step",
    "elapsed_s",
    "reward_mean",
    "staleness_mean",
    "staleness_max",
    "groups",
    "samples",
    "samples_per_s",
    "tokens",
    "loss",
    "entropy",
    "is_weight_mean",
    "grad_norm",
    "pg_clipfrac",
    "ppo_kl",
    "kl_ref",
    "truncated_frac",
    "step_time_s",
)


def _staleness(hist: dict[str, int]) -> tuple[float, int]:
    total = sum(hist.values())
    if not total:
        return 0.0, 0
    return sum(int(k) * v for k, v in hist.items()) / total, max(int(k) for k in hist)


def step_rows(
    steps: list[dict[str, Any]], *, started_at: float | None = None
) -> list[dict[str, Any]]:
    """One flat row per step record (sorted by step), with the `COLUMNS`."""
    records = sorted(steps, key=lambda r: int(r["step"]))
    origin = started_at if started_at is not None else (records[0]["time"] if records else 0.0)
    rows: list[dict[str, Any]] = []
    previous = started_at
    for record in records:
        mean, worst = _staleness(record.get("staleness_hist", {}))
        interval = float(record["time"]) - previous if previous is not None else 0.0
        rows.append(
            {
                "step": int(record["step"]),
                "elapsed_s": round(float(record["time"]) - origin, 3),
                "reward_mean": float(record.get("reward_mean", float("nan"))),
                "staleness_mean": mean,
                "staleness_max": worst,
                "groups": int(record.get("groups", 0)),
                "samples": int(record.get("samples", 0)),
                "samples_per_s": int(record.get("samples", 0)) / interval
                if interval > 0
                else float("nan"),
                "tokens": float(record.get("tokens", 0.0)),
                "loss": float(record.get("loss", float("nan"))),
                "entropy": float(record.get("entropy", float("nan"))),
                "is_weight_mean": float(record.get("is_weight_mean", float("nan"))),
                "grad_norm": float(record.get("grad_norm", float("nan"))),
                "pg_clipfrac": float(record.get("pg_clipfrac", float("nan"))),
                "ppo_kl": float(record.get("ppo_kl", float("nan"))),
                "kl_ref": float(record.get("kl_ref", float("nan"))),
                "truncated_frac": float(record.get("truncated_frac", float("nan"))),
                "step_time_s": float(record.get("step_time_s", float("nan"))),
            }
        )
        previous = float(record["time"])
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict[str, Any]], *, wall_s: float) -> dict[str, Any]:
    """The headline numbers: reward over the first and last 10% of steps, and the run's size."""
    k = max(1, math.ceil(len(rows) / 10)) if rows else 0
    rewards = [r["reward_mean"] for r in rows]
    first = _mean(rewards[:k])
    last = _mean(rewards[-k:]) if k else float("nan")
    return {
        "steps": len(rows),
        "window_steps": k,
        "reward_first_10pct": first,
        "reward_last_10pct": last,
        "reward_gain": last - first,
        "samples_trained": sum(r["samples"] for r in rows),
        "staleness_mean": _mean([r["staleness_mean"] for r in rows]),
        "staleness_max": max((r["staleness_max"] for r in rows), default=0),
        "samples_per_s": (sum(r["samples"] for r in rows) / rows[-1]["elapsed_s"])
        if rows and rows[-1]["elapsed_s"] > 0
        else float("nan"),
        "wall_s": wall_s,
    }


def _jsonable(value: Any) -> Any:
    """NaN → null, so the files are strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    reward = [r["reward_mean"] for r in rows]
    window = max(1, len(rows) // 10)
    running = [_mean(reward[max(0, i - window + 1) : i + 1]) for i in range(len(reward))]
    axes[0].plot(steps, reward, ".", alpha=0.5, label="batch mean")
    axes[0].plot(steps, running, "-", label=f"running mean ({window} steps)")
    axes[0].set_ylabel("reward")
    axes[0].set_ylim(-0.05, 1.05)
    axes[0].legend(loc="lower right")
    axes[1].plot(steps, [r["staleness_mean"] for r in rows], "-", label="mean")
    axes[1].plot(steps, [r["staleness_max"] for r in rows], ".", label="max")
    axes[1].set_ylabel("staleness (versions)")
    axes[1].legend(loc="upper left")
    axes[2].plot(steps, [r["samples_per_s"] for r in rows], "-")
    axes[2].set_ylabel("samples trained / s")
    axes[2].set_xlabel("trainer step (policy version)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _text(summary: dict[str, Any]) -> str:
    lines = [
        f"steps: {summary['steps']} ({summary['samples_trained']} samples), "
        f"wall time {summary['wall_s']:.0f}s",
        f"reward, first 10% of steps: {summary['reward_first_10pct']:.3f}",
        f"reward, last 10% of steps:  {summary['reward_last_10pct']:.3f} "
        f"({summary['reward_gain']:+.3f})",
        f"staleness: mean {summary['staleness_mean']:.2f}, max {summary['staleness_max']}",
    ]
    if "bootstrap" in summary:
        lines.append(f"Kafka: {summary['bootstrap']}")
    for role, topic in summary.get("topics", {}).items():
        lines.append(f"  {role:<9} {topic}")
    for note in summary.get("notes", []):
        lines.append(note)
    if "replay" in summary:
        lines.append("replay a topic (as JSON lines):")
        lines.extend(f"  {command}" for command in summary["replay"])
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: str | Path,
    steps: list[dict[str, Any]],
    *,
    wall_s: float,
    info: dict[str, Any] | None = None,
    started_at: float | None = None,
    title: str = "rollout demo",
) -> dict[str, Any]:
    """Write the report files of the module docstring into `out_dir`; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = step_rows(steps, started_at=started_at)
    summary = {**summarize(rows, wall_s=wall_s), **(info or {})}
    with (out / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    (out / "metrics.json").write_text(json.dumps(_jsonable(rows), indent=1) + "\n")
    (out / "summary.json").write_text(
        json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n"
    )
    (out / "summary.txt").write_text(_text(summary))
    _plot(rows, out / "report.png", f"{title}: {len(rows)} steps in {wall_s:.0f}s")
    return summary
