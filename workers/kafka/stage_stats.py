"""`StageStats`: a stage's counters, logged, and optionally written as JSON after each batch.

Counters only grow. `snapshot()` is the counters sorted by name, then what a stage adds
(`extra_snapshot`), then `uptime_s`, `last_batch_s` and `pid`; `write()` replaces the file at
`path` atomically (write a temporary file, then rename), so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["StageStats"]


class StageStats:
    """Monotonic counters of one stage, plus the last batch's duration."""

    def __init__(self, path: str | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.path = Path(path) if path else None
        self.started = time.time()
        self.last_batch_s = 0.0

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def extra_snapshot(self) -> dict[str, Any]:
        """What a stage reports beside its counters (none here)."""
        return {}

    def snapshot(self) -> dict[str, Any]:
        return {
            **dict(sorted(self.counts.items())),
            **self.extra_snapshot(),
            "uptime_s": round(time.time() - self.started, 3),
            "last_batch_s": round(self.last_batch_s, 4),
            "pid": os.getpid(),
        }

    def write(self, extra: dict[str, Any] | None = None) -> None:
        """Write the snapshot (and `extra`) atomically to `path`, if one is set."""
        if self.path is None:
            return
        data = {**self.snapshot(), **(extra or {})}
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
