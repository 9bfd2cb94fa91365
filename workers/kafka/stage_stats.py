"""`StageStats`: a stage's counters, logged, and optionally written as JSON after each batch.

Counters only grow. `snapshot()` is the counters sorted by name, then what a stage adds
(`extra_snapshot`), then `uptime_s`, `last_batch_s` and `pid`; `write()` replaces the file at
`path` atomically (write a temporary file, then rename), so a reader never sees half of one.
`warn_growth` says in the log, with the count, when records were dropped as already done, so
a drop is never silent; `log_every` logs the snapshot every so often.
"""

from __future__ import annotations

import json
import logging
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
        self._warned: dict[tuple[str, ...], tuple[int, float]] = {}
        self._logged = time.monotonic()

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

    def warn_growth(
        self, names: tuple[str, ...], message: str, logger: logging.Logger, every_s: float = 10.0
    ) -> None:
        """Log `message` (one `%d`: the total) at WARNING when the counters `names` together
        grew since the last time it was logged, at most once every `every_s`."""
        total = sum(self.counts[name] for name in names)
        said, at = self._warned.get(names, (0, 0.0))
        now = time.monotonic()
        if total > said and now - at >= every_s:
            self._warned[names] = (total, now)
            logger.warning(message, total)

    def log_every(self, logger: logging.Logger, stage: str, every_s: float = 30.0) -> None:
        """Log the snapshot at INFO (`<stage> stats: {...}`) when more than `every_s` passed
        since it was last logged (or since these stats began)."""
        now = time.monotonic()
        if now - self._logged > every_s:
            self._logged = now
            logger.info("%s stats: %s", stage, self.snapshot())

    def write(self, extra: dict[str, Any] | None = None) -> None:
        """Write the snapshot (and `extra`) atomically to `path`, if one is set."""
        if self.path is None:
            return
        data = {**self.snapshot(), **(extra or {})}
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
