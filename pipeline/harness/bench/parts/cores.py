"""The fair CPU split of a benchmark: which processes run on which core.

A bench that compares a side in process with a side through Kafka must give the agent loops
and the replicas the same CPU on both sides, or the ratio measures who got the cores. On a
machine with two or more usable CPUs `CoreSplit` pins, with `os.sched_setaffinity`:
- `compute` (the agent loops: the bench process itself, or a worker process, and the
  replicas) to one core;
- `transport` (the broker's JVM and the turns reader) to another.
The in-process side keeps the same core for loops and replicas; the other core is then idle.

Affinity is per thread on Linux: a process is pinned by pinning every thread it has now
(`/proc/<pid>/task`); threads it starts later inherit from the thread that starts them.
Every affinity changed is restored on `close()` (a process that has exited is skipped).
With fewer than two CPUs, or where the kernel refuses (a container's cpuset, no permission),
`plan` is None, `reason` says why, and nothing is pinned: the bench runs unpinned and says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["CoreSplit", "split_of"]


def split_of(cpus: set[int]) -> tuple[dict[str, list[int]] | None, str | None]:
    """The cores of `compute` and `transport` out of `cpus` (the usable ones), or None and
    why not. The lowest core computes, the next one carries the transport."""
    if len(cpus) < 2:
        return None, f"{len(cpus)} usable CPU: no second core for the broker and the reader"
    first, second = sorted(cpus)[:2]
    return {"compute": [first], "transport": [second]}, None


def _threads(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:
        return []


class CoreSplit:
    """Pins processes to their group's cores (`pin`) and restores them all (`close`).

    `CoreSplit(enabled=False)` pins nothing and reports `cpu_split: null` with the reason.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self._saved: dict[int, set[int]] = {}
        self.plan: dict[str, list[int]] | None = None
        self.reason: str | None = "turned off (--cpu-split 0)"
        self.pinned: dict[str, list[int]] = {}  # group -> pids pinned (for the report)
        if not enabled:
            return
        if not hasattr(os, "sched_setaffinity"):
            self.reason = "this platform has no sched_setaffinity"
            return
        self.plan, self.reason = split_of(os.sched_getaffinity(0))
        if self.plan is not None:
            try:  # the kernel may refuse (a cpuset that names other cores): find out now
                self._set(os.getpid(), self.plan["compute"])
            except OSError as exc:
                self.plan, self.reason = None, f"sched_setaffinity failed: {exc}"

    def _set(self, pid: int, cores: list[int]) -> None:
        for tid in _threads(pid) or [pid]:
            try:
                self._saved.setdefault(tid, os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue

    def pin(self, group: str, pid: int | None) -> None:
        """Pin every thread of `pid` to `group`'s cores (nothing when unpinned or no pid)."""
        if self.plan is None or pid is None:
            return
        self._set(pid, self.plan[group])
        if pid not in self.pinned.setdefault(group, []):
            self.pinned[group].append(pid)

    def report(self, components: dict[str, str]) -> dict[str, Any]:
        """`cpu_split`: each component's cores (`components` maps it to its group), or None
        and `cpu_split_reason`."""
        if self.plan is None:
            return {"cpu_split": None, "cpu_split_reason": self.reason}
        plan = self.plan
        return {"cpu_split": {name: plan[group] for name, group in components.items()}}

    def close(self) -> None:
        for tid, cores in self._saved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # the thread or its process has exited: nothing to restore
                continue
        self._saved.clear()

    def __enter__(self) -> CoreSplit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
