"""The faults the chaos suite injects, and when.

A fault is named `kill:<process>` (SIGKILL to the process group, then start it again),
`term:<process>` (SIGTERM: a clean bounce), `stop:<process>` (SIGSTOP for longer than the
consumer session timeout, then SIGCONT: the group rebalances away from a process that is
still alive and comes back with stale assignments), or `broker` (stop and start the broker,
same port and data). On a cluster of three brokers (`rollout chaos --brokers 3`) the broker
faults are `kill:broker` (SIGKILL the broker leading the most partitions of `rl.turns`, start it
again later), `stop:broker` (SIGSTOP it past the brokers' and the stages' session timeouts, then
SIGCONT), `kill:broker-N`/`stop:broker-N` (node N), and `bounce:brokers` (a rolling restart of
all, as an upgrade); `pipeline.harness.chaos.cluster` fires them. Faults fire one at a time, each
when the run's progress (the share of samples already scored) passes its trigger; the
triggers are drawn at random from the seed, spread over the middle of the run so every fault
lands while data is moving.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CLUSTER_FAULTS",
    "DEFAULT_FAULTS",
    "Fault",
    "OwnBroker",
    "inject",
    "parse_fault",
    "schedule",
]

DEFAULT_FAULTS = (
    "kill:agent-loop-0",
    "kill:reward",
    "kill:replay",
    "kill:train",
    "kill:replica-1",
    "stop:agent-loop-1",
    "broker",
)
#: `--brokers 3`: the stage faults above, and the broker faults in place of `broker`.
CLUSTER_FAULTS = (
    *(f for f in DEFAULT_FAULTS if f != "broker"),
    "kill:broker",
    "stop:broker",
    "bounce:brokers",
)
_KINDS = ("kill", "term", "stop", "bounce")


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | term | stop | bounce | broker
    target: str  # process name; "" for the broker; broker, broker-N or brokers on a cluster
    trigger: float = 0.0  # share of samples accounted for when it fires

    @property
    def name(self) -> str:
        return "broker" if self.kind == "broker" else f"{self.kind}:{self.target}"

    @property
    def on_cluster(self) -> bool:
        """A fault of a cluster's brokers (kill:broker, stop:broker-2, bounce:brokers)."""
        return self.target in ("broker", "brokers") or self.target.startswith("broker-")


def parse_fault(text: str) -> Fault:
    if text == "broker":
        return Fault("broker", "")
    kind, sep, target = text.partition(":")
    if not sep or kind not in _KINDS or not target:
        raise ValueError(f"bad fault {text!r}: expected broker or one of {_KINDS} ':' process")
    fault = Fault(kind, target)
    node = target.removeprefix("broker-")
    if target.startswith("broker-") and not node.isdigit():
        raise ValueError(f"bad fault {text!r}: broker-N names a node by its number (1, 2, 3)")
    if (kind == "bounce") != (target == "brokers"):
        raise ValueError(f"bad fault {text!r}: the rolling restart is bounce:brokers")
    if fault.on_cluster and kind not in ("kill", "stop", "bounce"):
        raise ValueError(f"bad fault {text!r}: a broker is killed, stopped or bounced")
    return fault


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


class OwnBroker:
    """The run's own broker, which the `broker` fault restarts (same port, same data)."""

    def __init__(self, home: Path) -> None:
        from workers.ports import free_port

        self.port = free_port()
        self.data = home / "kafka"
        self.bootstrap = ""

    def start(self) -> None:
        from pipeline.broker.local import start_broker

        self.bootstrap = start_broker(self.port, self.data, quiet=True).bootstrap

    def stop(self, purge: bool = False) -> None:
        from pipeline.broker.local import stop_broker

        stop_broker(self.port, purge=purge)


def inject(
    fault: Fault, pipe: Any, sup: Any, broker: OwnBroker | None, stop_s: float
) -> dict[str, Any]:
    """Fire a fault of one of the pipeline's processes (`pipe`, a `LocalPipeline`, whose
    supervisor `sup` must not restart it meanwhile), or restart the one broker; return once
    it is over."""
    started = time.monotonic()
    if fault.kind == "broker":
        if broker is None:
            raise ValueError("the broker fault needs the run's own broker (no --bootstrap)")
        broker.stop()
        time.sleep(2.0)
        broker.start()
    else:
        proc = pipe.process(fault.target)
        sup.held.add(proc.name)
        try:
            if fault.kind == "stop":
                proc.signal(signal.SIGSTOP)
                time.sleep(stop_s)
                proc.signal(signal.SIGCONT)
            else:
                proc.signal(signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)
                deadline = time.monotonic() + 60
                while proc.alive and time.monotonic() < deadline:
                    time.sleep(0.1)
                if proc.alive:
                    proc.signal(signal.SIGKILL)
                    time.sleep(0.5)
                pipe.restart(proc.name)
        finally:
            sup.held.discard(proc.name)
    return {
        "fault": fault.name,
        "trigger": fault.trigger,
        "seconds": round(time.monotonic() - started, 1),
    }
