"""How full a replica is, as `routing="load"` ranks it: load over capacity, unknown ≠ idle.

    fill = (reported load + requests sent since the report) / capacity

- *load*: the replica's own running + waiting requests, from the `X-Rollout-Load` header of
  every response and `load` in /health; *since*: the requests this process sent it after that
  report (the report cannot count them yet). With several worker processes, each one's report
  counts the others' requests, so the rank sees the whole cluster, not one process's share.
- *capacity*: the requests the replica runs at once (`X-Rollout-Capacity`: the hf engine's
  batch limit, vLLM's `max_num_seqs` × data-parallel size). A count alone cannot tell that 4
  waiting on a replica that batches 16 is less than 2 on one that runs 1 at a time.
- A replica that never reported a capacity is taken to be as small as the smallest one that
  did (1 when none did: then fill is the plain count, the rule before capacities). Guessing
  small is the safe side: a replica of unknown size never draws more than the smallest share.
- A replica whose last load report is older than the cutoff (or that never reported) is
  *unknown*, not idle: its fill is its in-flight from this process over its capacity plus the
  highest fill a fresh replica reported. It is never preferred for being silent, yet still
  takes work while the others are busy; when every replica is unknown, the rank is this
  process's own in-flight per capacity.

Pure: no clock, no I/O; the caller passes the cutoff. Fills are ratios of small integers, so
equal fills compare equal as floats and the balancer's tie rules apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["ReplicaLoad", "fills"]


class ReplicaLoad(Protocol):
    load: int  # -1: never reported
    load_at: float  # when (the caller's clock)
    since: int
    capacity: int  # 0: never reported


def fills(
    replicas: Sequence[ReplicaLoad], inflight: Sequence[int], fresh_after: float
) -> list[float]:
    """The fill of each replica (same order); reports at or after `fresh_after` are fresh."""
    smallest = min((r.capacity for r in replicas if r.capacity > 0), default=1)
    caps = [r.capacity or smallest for r in replicas]
    fresh = [r.load >= 0 and r.load_at >= fresh_after for r in replicas]
    floor = max(
        (r.load / c for r, c, f in zip(replicas, caps, fresh, strict=True) if f), default=0.0
    )
    return [
        (r.load + r.since) / c if f else n / c + floor
        for r, n, c, f in zip(replicas, inflight, caps, fresh, strict=True)
    ]
