"""The replay stage's counters: one small object, logged, and optionally written as JSON.

Counters only grow:

    samples             scored trajectories consumed     ticks          idle sweeps (no sample for tick_interval_s)
    decode_errors       undecodable / wrong kind / key ≠ uid, dead-lettered
    duplicates          a sample index already in its group (redelivery, second attempt)
    late_samples        a new sample index for a group already finished (counted, logged)
    beyond_n            sample_index >= n: the prompt's n differs from the configured one
    groups_complete     groups finished with all n samples
    groups_partial      groups finished by the timeout
    emitted             groups produced to rl.replay
    dropped_<reason>    groups produced to rl.stale (stale, zero_variance, timeout)
    emit_recovered_present  after a restart: already on its topic, not produced again
    emit_recovered_missing  after a restart: marked but absent, finished again now

`staleness` is a histogram (staleness → groups) over every finished group, emitted or not;
`policy_version` is the latest version seen on rl.policy.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["ReplayStats"]


class ReplayStats:
    """Monotonic counters, the staleness histogram and the last batch's timing."""

    def __init__(self, path: str | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.path = Path(path) if path else None
        self.started = time.time()
        self.last_batch_s = 0.0
        self.policy_version = 0

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def observe_staleness(self, staleness: int) -> None:
        self.staleness[staleness] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            **dict(sorted(self.counts.items())),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "policy_version": self.policy_version,
            "uptime_s": round(time.time() - self.started, 3),
            "last_batch_s": round(self.last_batch_s, 4),
            "pid": os.getpid(),
        }

    def write(self) -> None:
        """Write the snapshot atomically to `path` (if one is set)."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self.path)
