"""The pure parts of the soak: the backlog controller, latency percentiles, throughput per
stage from counter snapshots, the memory-growth check, and the printed tables.

Nothing here touches a process, a socket or the clock; `run.py` feeds it numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BacklogController",
    "MemoryRow",
    "latency_summary",
    "memory_rows",
    "percentile",
    "render",
    "stage_rates",
    "stale_share",
]

# (stage, topic, "consumed" | "produced") → counter value, summed over a stage's processes
Counters = Mapping[tuple[str, str, str], float]


@dataclass
class BacklogController:
    """Keep `target` prompts waiting on the prompts topic, never more.

    The backlog is what was produced minus what the agent-loop workers have taken from the
    topic (their `rollout_messages_consumed_total` on it). The workers pause their partitions
    while they are full or the staleness gate is closed, so a backlog that stays topped up
    means the pipeline is offered exactly as much as its slowest stage lets through: the
    consumption rate is then the highest rate it sustains. `max_burst` bounds one top-up.
    """

    target: int
    max_burst: int = 256

    def to_send(self, produced: int, consumed: int) -> int:
        backlog = max(0, produced - consumed)
        return max(0, min(self.target - backlog, self.max_burst))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(latencies: Sequence[float]) -> dict[str, float | int]:
    return {
        "count": len(latencies),
        "p50_s": round(percentile(latencies, 50), 3) if latencies else math.nan,
        "p99_s": round(percentile(latencies, 99), 3) if latencies else math.nan,
        "max_s": round(max(latencies), 3) if latencies else math.nan,
    }


def stage_rates(before: Counters, after: Counters, seconds: float) -> dict[str, dict[str, float]]:
    """stage → "consumed <topic>" / "produced <topic>" → messages/s between two snapshots."""
    rates: dict[str, dict[str, float]] = {}
    for key in sorted(set(before) | set(after)):
        stage, topic, direction = key
        delta = after.get(key, 0.0) - before.get(key, 0.0)
        rates.setdefault(stage, {})[f"{direction} {topic}"] = (
            round(delta / seconds, 2) if seconds > 0 else 0.0
        )
    return rates


@dataclass(frozen=True)
class MemoryRow:
    process: str
    start_mb: float
    baseline_mb: float
    end_mb: float
    peak_mb: float
    checked: bool  # False: reported only (e.g. the broker, whose heap is bounded by -Xmx)

    @property
    def growth_pct(self) -> float:
        if self.baseline_mb <= 0:
            return math.inf
        return (self.end_mb - self.baseline_mb) / self.baseline_mb * 100.0

    def ok(self, limit_pct: float) -> bool:
        return not self.checked or self.growth_pct < limit_pct


def memory_rows(
    samples: Mapping[str, Mapping[str, int]], checked: Iterable[str]
) -> list[MemoryRow]:
    """`samples`: moment ("start", "baseline", "end", "peak") → process → RSS bytes."""
    mb = 1024 * 1024
    names = sorted(samples.get("end", {}) or samples.get("start", {}))
    wanted = set(checked)
    return [
        MemoryRow(
            process=name,
            start_mb=round(samples.get("start", {}).get(name, 0) / mb, 1),
            baseline_mb=round(samples.get("baseline", {}).get(name, 0) / mb, 1),
            end_mb=round(samples.get("end", {}).get(name, 0) / mb, 1),
            peak_mb=round(samples.get("peak", {}).get(name, 0) / mb, 1),
            checked=name in wanted,
        )
        for name in names
    ]


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [list(map(str, headers)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def stale_share(steps: Iterable[Mapping[str, Any]], bound: int) -> dict[str, Any]:
    """Of the groups the trainer trained, the share past the staleness bound (the soak keeps
    them all, so this is what the admission gate let through; it should be 0)."""
    hist: Counter[int] = Counter()
    for step in steps:
        for staleness, count in (step.get("staleness_hist") or {}).items():
            hist[int(staleness)] += int(count)
    total = sum(hist.values())
    past = sum(c for s, c in hist.items() if s > bound)
    return {
        "groups_trained": total,
        "stale_share": round(past / total, 4) if total else 0.0,
        "staleness_max": max(hist, default=0),
        "max_staleness": bound,
    }


def render(report: Mapping[str, Any]) -> str:
    """The report as readable tables (the JSON object holds the same figures)."""
    base = report["baseline_minute"]
    out = [
        f"soak: {report['minutes']} min of load after {report['ready_s']} s of start-up; "
        f"backlog of {report['backlog_target']} prompts kept offered; achieved "
        f"{report['prompts_per_s']} prompts/s, {report['trajectories_per_s']} trajectories/s",
        f"staleness: {100 * report['stale_share']:.1f}% of the trained groups past the bound "
        f"of {report['max_staleness']} (largest {report['staleness_max']})",
        "",
        f"throughput per stage (messages/s, minute {base} to the end)",
    ]
    flows = [(s, k, r) for s, row in report["throughput"].items() for k, r in row.items()]
    out += [_table(["stage", "direction topic", "msg/s"], flows), ""]

    lat = report["latency"]
    out += [
        f"end-to-end latency, prompt produced -> trajectory scored, prompts of minute {base} "
        f"to the end ({lat['count']} trajectories, {lat['unscored']} never scored): "
        f"p50 {lat['p50_s']} s, p99 {lat['p99_s']} s, max {lat['max_s']} s",
        "",
    ]

    columns = sorted({f"{g} {t}" for s in report["lag"] for g, t in _pairs(s["groups"])})
    lag_rows = [[s["t_s"], *(_lag(s["groups"], c) for c in columns)] for s in report["lag"]]
    out += ["consumer lag (messages) over time", _table(["t (s)", *columns], lag_rows), ""]

    limit = report["memory_limit_pct"]
    headers = ["process", "start", f"minute {base}", "end", "peak", "growth %", "check"]
    mem_rows = [
        [
            r["process"],
            r["start_mb"],
            r["baseline_mb"],
            r["end_mb"],
            r["peak_mb"],
            f"{r['growth_pct']:+.1f}",
            ("ok" if r["ok"] else "FAIL") if r["checked"] else "-",
        ]
        for r in report["memory"]
    ]
    out += [
        f"memory (RSS with children, MiB); growth from minute {base} to the end must stay "
        f"under {limit}%",
        _table(headers, mem_rows),
        "",
    ]
    out += [f"FAIL: {problem}" for problem in report["problems"]]
    out.append("OK" if report["ok"] else "NOT OK")
    return "\n".join(out)


def _pairs(groups: Mapping[str, Mapping[str, Any]]) -> Iterable[tuple[str, str]]:
    return ((g, t) for g, topics in groups.items() for t in topics)


def _lag(groups: Mapping[str, Mapping[str, int]], column: str) -> str:
    group, topic = column.split(" ", 1)
    value = groups.get(group, {}).get(topic)
    return "" if value is None else str(value)
