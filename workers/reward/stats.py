"""The reward stage's counters: one small object, logged, and optionally written as JSON.

Counters only grow. Outcomes of `assembler.apply_turn` are counted under their own names
(`added`, `complete`, `duplicate_completion`, `stale_attempt`, ...); the rest:

    turns               turn events consumed          decode_errors    undecodable, dead-lettered
    scored              emitted with a real score     failure_scored   emitted with failure_score
    dead_lettered       trajectories sent to rl.dlq   unknown_data_source  (also dead-lettered)
    scorer_errors       scorers that raised           scorer_timeouts  scorers that timed out
    unparseable_verdicts  the judge answered with no verdict (failure-scored, tagged)
    emit_recovered_present  after a restart: already on rl.scored, not emitted again
    done_expired        DONE states deleted after `done_retention_s`

Timers (seconds, summed over batches): `t_decode`, `t_score` (assembly and scoring),
`t_send`, `t_batch` (the batch's own work) and `t_settle` (waiting for the broker's
acknowledgements, overlapped with the next batch).
"""

from __future__ import annotations

import time
from typing import Any

from workers.kafka.stage_stats import StageStats

__all__ = ["RewardStats"]


class RewardStats(StageStats):
    """The stage's counters, plus its timers."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(path)
        self.seconds: dict[str, float] = {}

    def timing(self, name: str, since: float) -> float:
        """Add the seconds since `since` to timer `name`; return now (monotonic)."""
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - since
        return now

    def extra_snapshot(self) -> dict[str, Any]:
        return {k: round(v, 3) for k, v in sorted(self.seconds.items())}
