"""The trainer's step log: one JSON object per line, and how to read it back.

Records (`event` field):
- `start`: a trainer process began at `version` (0, or the checkpoint it resumed from);
- `step`: one optimiser step, `step` = the version it produced, with the metrics (among
  them `reward_mean`, the mean score of the samples trained; for a Mixture-of-Experts policy
  whose samples carry their routing, `router_mismatch_rate` and `router_rows`, and with
  `router_replay=r3` `router_live_mismatch_rate`: `workers.trainer.router_replay`) and the
  `trajectory_ids` / `uids` it trained on;
- `checkpoint`: `version` was checkpointed at `path` and published.

Reading back (`effective_steps`): a step is reflected in the final weights only if no later
`start` resumed from a version below it (steps after the last checkpoint of a process that
died were lost with it and trained again after the restart). Lines are flushed as written,
so a killed process loses at most the line it was writing (ignored when read back).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

__all__ = ["StepLog", "effective_steps", "effective_trajectory_ids", "staleness_histogram"]

log = logging.getLogger("rollout.trainer.steplog")


class StepLog:
    """Append-only JSON-lines writer (one line per record, flushed)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True, default=_plain) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def staleness_histogram(staleness: Iterable[int]) -> dict[str, int]:
    """{"0": n0, "1": n1, …} (string keys: JSON objects)."""
    counts = Counter(staleness)
    return {str(k): counts[k] for k in sorted(counts)}


def _records(path: str | Path) -> Iterable[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                log.warning("ignoring a torn line in %s", path)


def effective_steps(path: str | Path, upto: int | None = None) -> dict[int, dict[str, Any]]:
    """Step number → its `step` record, for the steps the final weights reflect.

    `upto`: the version of the checkpoint the run ended with, when its last process died
    without a final checkpoint (its later steps are dropped too).
    """
    steps: dict[int, dict[str, Any]] = {}
    for record in _records(path):
        kind = record.get("event")
        if kind == "start":
            base = int(record["version"])
            steps = {n: r for n, r in steps.items() if n <= base}
        elif kind == "step":
            steps[int(record["step"])] = record
    if upto is not None:
        steps = {n: r for n, r in steps.items() if n <= upto}
    return dict(sorted(steps.items()))


def effective_trajectory_ids(path: str | Path, upto: int | None = None) -> list[str]:
    """Every trajectory id trained into the final weights, in step order (duplicates kept)."""
    return [t for r in effective_steps(path, upto).values() for t in r["trajectory_ids"]]
