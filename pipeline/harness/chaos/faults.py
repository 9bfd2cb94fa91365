"""The faults the chaos suite injects, and when.

A fault is named `kill:<process>` (SIGKILL to the process group, then start it again),
`term:<process>` (SIGTERM: a clean bounce), `stop:<process>` (SIGSTOP for longer than the
consumer session timeout, then SIGCONT: the group rebalances away from a process that is
still alive and comes back with stale assignments), or `broker` (stop and start the broker,
same port and data). Faults fire one at a time, each when the run's progress (the share of
samples already scored) passes its trigger; the triggers are drawn at random from
the seed, spread over the middle of the run so every fault lands while data is moving.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["DEFAULT_FAULTS", "Fault", "parse_fault", "schedule"]

DEFAULT_FAULTS = (
    "kill:agent-loop-0",
    "kill:reward",
    "kill:replay",
    "kill:train",
    "kill:replica-1",
    "stop:agent-loop-1",
    "broker",
)
_KINDS = ("kill", "term", "stop")


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | term | stop | broker
    target: str  # process name; "" for the broker
    trigger: float = 0.0  # share of samples accounted for when it fires

    @property
    def name(self) -> str:
        return "broker" if self.kind == "broker" else f"{self.kind}:{self.target}"


def parse_fault(text: str) -> Fault:
    if text == "broker":
        return Fault("broker", "")
    kind, sep, target = text.partition(":")
    if not sep or kind not in _KINDS or not target:
        raise ValueError(f"bad fault {text!r}: expected broker or one of {_KINDS} ':' process")
    return Fault(kind, target)


def schedule(
    names: list[str] | tuple[str, ...], seed: int, lo: float = 0.08, hi: float = 0.8
) -> list[Fault]:
    """The faults in a random order, with increasing random triggers in [lo, hi)."""
    rng = random.Random(seed)
    faults = [parse_fault(n) for n in names]
    rng.shuffle(faults)
    if not faults:
        return []
    width = (hi - lo) / len(faults)
    return [
        Fault(f.kind, f.target, round(lo + width * (i + rng.random()), 4))
        for i, f in enumerate(faults)
    ]
