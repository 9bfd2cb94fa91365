"""The reward stage's counters: one small object, logged, and optionally written as JSON.

Counters only grow. Outcomes of `assembler.apply_turn` are counted under their own names
(`added`, `complete`, `duplicate_completion`, `stale_attempt`, ...); the rest:

    turns               turn events consumed          decode_errors    undecodable, dead-lettered
    scored              emitted with a real score     failure_scored   emitted with failure_score
    dead_lettered       trajectories sent to rl.dlq   unknown_data_source  (also dead-lettered)
    scorer_errors       scorers that raised           scorer_timeouts  scorers that timed out
    emit_recovered_present  after a restart: already on rl.scored, not emitted again
    done_expired        DONE states deleted after `done_retention_s`

Timers (seconds, summed over batches): `t_decode`, `t_score` (assembly and scoring),
`t_send`, `t_batch` (the batch's own work) and `t_settle` (waiting for the broker's
acknowledgements, overlapped with the next batch).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["RewardStats"]


class RewardStats:
    """Monotonic counters of the stage, plus timing of the last batch."""

    def __init__(self, path: str | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.path = Path(path) if path else None
        self.started = time.time()
        self.last_batch_s = 0.0
        self.seconds: dict[str, float] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def timing(self, name: str, since: float) -> float:
        """Add the seconds since `since` to timer `name`; return now (monotonic)."""
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - since
        return now

    def snapshot(self) -> dict[str, Any]:
        return {
            **dict(sorted(self.counts.items())),
            **{k: round(v, 3) for k, v in sorted(self.seconds.items())},
            "uptime_s": round(time.time() - self.started, 3),
            "last_batch_s": round(self.last_batch_s, 4),
            "pid": os.getpid(),
        }

    def write(self, extra: dict[str, Any] | None = None) -> None:
        """Write the snapshot atomically to `path` (if one is set)."""
        if self.path is None:
            return
        data = {**self.snapshot(), **(extra or {})}
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
