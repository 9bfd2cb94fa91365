"""The CPU figures of `rollout bench agent-loop`, from each component's CPU seconds per round.

Pure arithmetic (no broker, no process): per side, each component's median CPU seconds over
the rounds per trajectory, what one core of it sustains, the worker's CPU over the bare
loops', and the projection of what the cores sustain if they are never idle.
"""

from __future__ import annotations

import statistics
from typing import Any

from pipeline.harness.bench.common import per_core_rate

__all__ = ["cpu_figures", "projection"]


def cpu_figures(cpu: dict[str, dict[str, list[float]]], samples: int) -> dict[str, Any]:
    """CPU seconds per trajectory of each component on each side (median of the rounds),
    what one core of each sustains, and the loops' CPU through Kafka over in process."""
    per_traj = {
        side: {name: statistics.median(values) / samples for name, values in parts.items()}
        for side, parts in cpu.items()
    }
    loops = per_traj["direct"].get("loops", 0.0)
    return {
        "cpu_s_per_trajectory": {
            side: {name: round(v, 6) for name, v in parts.items()}
            for side, parts in per_traj.items()
        },
        "trajectories_per_core_s": {
            side: {name: round(per_core_rate(1, v), 1) for name, v in parts.items()}
            for side, parts in per_traj.items()
        },
        # The worker (loops + Kafka path) over the bare loops, in CPU per trajectory.
        "worker_cpu_ratio_to_direct": round(per_traj["kafka"]["loops"] / loops, 3)
        if loops
        else None,
    }


def projection(per_traj: dict[str, float], groups: dict[str, str] | None, cpus: int) -> float:
    """Trajectories per second the cores sustain if never idle, from each component's CPU
    seconds per trajectory: pinned (`groups`: component → core group, one core each), the
    least over the groups of 1 / the CPU per trajectory of what runs there; unpinned, `cpus`
    over the sum of them all. 0 when nothing was charged."""
    if groups is None:
        total = sum(per_traj.values())
        return cpus / total if total > 0 else 0.0
    load: dict[str, float] = {}
    for name, seconds in per_traj.items():
        group = groups.get(name)
        if group is not None:
            load[group] = load.get(group, 0.0) + seconds
    busiest = max(load.values(), default=0.0)
    return 1 / busiest if busiest > 0 else 0.0
