"""The replay stage's counters: one small object, logged, and optionally written as JSON.

Counters only grow:

    samples             scored trajectories consumed
    ticks               idle sweeps (no sample for sweep_interval_s)
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

from collections import Counter
from typing import Any

from workers.kafka.stage_stats import StageStats

__all__ = ["ReplayStats"]


class ReplayStats(StageStats):
    """The stage's counters, the staleness histogram and the latest policy version."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(path)
        self.staleness: Counter[int] = Counter()
        self.policy_version = 0

    def observe_staleness(self, staleness: int) -> None:
        self.staleness[staleness] += 1

    def extra_snapshot(self) -> dict[str, Any]:
        return {
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "policy_version": self.policy_version,
        }
