"""In-process load balancer over inference replicas: sticky first, then least in-flight.

Contract:
    `acquire(request_id)` chooses a replica *and* counts one request in flight on it, in one
    synchronous step. There is no `await` anywhere in this module, so under asyncio every call
    is atomic: two coroutines can never both see the same replica as least loaded and both take
    it. Every `acquire` must be paired with exactly one `release(replica, request_id)`.

Routing rule, in order:
    1. Sticky: a bounded LRU (`OrderedDict`) maps request/session id -> the replica that served it
       last (multi-turn trajectories reuse the replica's prefix cache). An entry whose replica has
       left (removed, or marked unhealthy) is dropped lazily on its next lookup.
    2. Least in-flight among routable replicas.
    3. Ties: deterministic mode picks `tied[crc32(id) % len(tied)]` (replicas in replica-id
       order), which is stable across processes; Python's `hash()` is salted per process and is
       never used. Otherwise a rotating counter spreads ties round-robin.

    `routing="load"` (load-aware) keeps 1 and replaces 2 by the least *fill*: the load each
    replica last reported (running + waiting, from every response's `X-Rollout-Load` header and
    from /health: `report`/`release(load=..., capacity=...)`) plus the requests this balancer
    sent it since, over the requests it runs at once (`X-Rollout-Capacity`). Several worker
    processes then see each other's load through the replica. Silent replicas are unknown, not
    idle; unknown capacities are taken as the smallest known (`workers.llm.fill`, the rule in
    full). Ties as in 3. Cost: O(replicas) per acquire (the default mode stays O(1)).

    `routing="round_robin"` replaces all three with plain rotation over the routable replicas
    (in replica-id order), ignoring ids and loads and never touching the sticky LRU. It exists
    as the baseline that sticky routing is measured against
    (`pipeline.harness.bench.prefix_routing`), not for serving.

Invariants:
    - A balancer routes to replicas of one role (`role`: the agent loops' `policy`, the reward
      stage's `judge`); `add_replicas` refuses a replica of another role, so a policy router
      never knows a judge, whatever its discovery hands it.
    - Routable replicas are kept sorted by `replica_id`, so routing depends only on the ids, the
      order of calls, and (deterministic mode) the request ids; never on insertion or set order.
    - In-flight counts never go negative; a replica that leaves keeps its count, so a request
      released after its replica left (or came back) is accounted correctly.
    - The hot path touches only plain lists, one `OrderedDict` and slot integers; no pydantic.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal, get_args

from schemas.events import ReplicaRole
from workers.llm.exceptions import NoReplicaError
from workers.llm.fill import fills

__all__ = ["Balancer", "Replica", "Routing", "stable_hash"]

Routing = Literal["sticky", "load", "round_robin"]
"""`sticky`: sticky LRU, then least in-flight of this process. `load`: sticky LRU, then least
reported load (see the module docstring). `round_robin`: rotation (baseline)."""

logger = logging.getLogger("rollout.llm.balancer")


def stable_hash(key: str) -> int:
    """A hash of `key` that is the same in every process (unlike the salted built-in `hash`)."""
    return zlib.crc32(key.encode())


class Replica:
    """One replica as the balancer sees it: an id, a base URL, and bookkeeping slots.

    Identity matters: a replica removed and added again under the same id is a new object, so
    sticky entries that point at the old object are dropped lazily.
    """

    __slots__ = (
        "_inflight",
        "_slot",
        "address",
        "capacity",
        "healthy",
        "load",
        "load_at",
        "replica_id",
        "role",
        "since",
        "version",
    )

    def __init__(
        self, replica_id: str, address: str, version: int = 0, role: ReplicaRole = "policy"
    ) -> None:
        self.replica_id = replica_id
        self.address = address.rstrip("/")
        self.version = version
        self.role: ReplicaRole = role
        self.healthy = True
        self._slot = -1  # index in the balancer's routable lists; -1 when not routable
        self._inflight = 0  # in-flight count while not routable (the list holds it otherwise)
        self.load = -1  # running + waiting the replica last reported; -1: never reported
        self.load_at = 0.0  # time.monotonic() of that report
        self.since = 0  # requests this balancer sent it since that report (routing="load")
        self.capacity = 0  # requests it runs at once, as it last reported; 0: never reported

    @property
    def routable(self) -> bool:
        return self._slot >= 0

    def __repr__(self) -> str:
        return f"Replica({self.replica_id!r}, {self.address!r}, healthy={self.healthy})"


class Balancer:
    """Sticky, least-in-flight replica chooser. Synchronous; safe under asyncio by construction."""

    __slots__ = (
        "_inflight",
        "_known",
        "_low",
        "_nlow",
        "_routable",
        "_rr",
        "_sticky",
        "deterministic",
        "load_ttl_s",
        "role",
        "routing",
        "sticky_size",
    )

    def __init__(
        self,
        *,
        sticky_size: int = 65536,
        deterministic: bool = False,
        routing: Routing = "sticky",
        load_ttl_s: float = 10.0,
        role: ReplicaRole = "policy",
    ) -> None:
        if sticky_size < 1:
            raise ValueError("sticky_size must be >= 1")
        if routing not in get_args(Routing):
            raise ValueError(f"routing must be one of {get_args(Routing)}, not {routing!r}")
        self.sticky_size = sticky_size
        self.deterministic = deterministic
        self.routing = routing
        self.load_ttl_s = load_ttl_s
        self.role: ReplicaRole = role
        self._known: dict[str, Replica] = {}
        self._routable: list[Replica] = []
        self._inflight: list[int] = []  # parallel to _routable
        self._sticky: OrderedDict[str, Replica] = OrderedDict()
        self._rr = 0
        self._low = 0  # least in-flight count among routable replicas
        self._nlow = 0  # how many routable replicas have exactly `_low` in flight

    # ---- hot path -------------------------------------------------------------------------

    def acquire(self, request_id: str) -> Replica:
        """Choose a replica for `request_id` and count one request in flight on it.

        Raises `NoReplicaError` when no replica is routable.
        """
        # `_low` is the least in-flight count and `_nlow` how many replicas have it; counts move
        # by +-1, so both are kept up to date in O(1) here and in `release` (no `min()` per call).
        if self.routing != "sticky":
            return (
                self._acquire_round_robin()
                if self.routing == "round_robin"
                else self._by_load(request_id)
            )
        sticky = self._sticky
        inflight = self._inflight
        rep = sticky.get(request_id)
        if rep is not None:
            slot = rep._slot
            if slot >= 0:
                sticky.move_to_end(request_id)
                c = inflight[slot]
                inflight[slot] = c + 1
                if c == self._low:
                    if self._nlow == 1:
                        self._low = c + 1
                        self._nlow = inflight.count(c + 1)
                    else:
                        self._nlow -= 1
                return rep
            del sticky[request_id]  # its replica left: fall through to least in-flight
        ties = self._nlow
        if not ties:
            raise NoReplicaError("no routable replica")
        low = self._low
        slot = inflight.index(low)
        if ties == 1:
            inflight[slot] = low + 1
            self._low = low + 1
            self._nlow = inflight.count(low + 1)
        else:
            if self.deterministic:
                k = zlib.crc32(request_id.encode()) % ties
            else:
                self._rr = k = (self._rr + 1) % ties
            while k:
                slot = inflight.index(low, slot + 1)
                k -= 1
            inflight[slot] = low + 1
            self._nlow = ties - 1
        rep = self._routable[slot]
        sticky[request_id] = rep
        if len(sticky) > self.sticky_size:
            sticky.popitem(last=False)
        return rep

    def release(
        self,
        replica: Replica,
        request_id: str = "",
        load: int | None = None,
        capacity: int | None = None,
    ) -> None:
        """Count one request of `replica` as finished (whether it succeeded or not).

        `request_id` is accepted for symmetry with `acquire` and for debugging; the sticky entry
        is kept, so the next turn of the same session returns to the same replica. `load` and
        `capacity`: what the replica reported on this request's response (`report`, in the
        same step).
        """
        if load is not None:
            self.report(replica, load, capacity)
        elif replica.since:
            replica.since -= 1  # no report: this one may have been among those sent since
        slot = replica._slot
        if slot >= 0:
            inflight = self._inflight
            c = inflight[slot] - 1
            if c >= 0:
                inflight[slot] = c
                if c < self._low:
                    self._low = c
                    self._nlow = 1
                elif c == self._low:
                    self._nlow += 1
        elif replica._inflight > 0:
            replica._inflight -= 1

    def report(self, replica: Replica, load: int, capacity: int | None = None) -> None:
        """The replica's own count of running + waiting requests, just received, and the
        requests it runs at once when it said (a capacity, once reported, stays until the next)."""
        replica.load, replica.load_at, replica.since = max(0, int(load)), time.monotonic(), 0
        if capacity is not None and capacity > 0:
            replica.capacity = int(capacity)

    def _by_load(self, request_id: str) -> Replica:
        """`routing="load"`: sticky, else least reported load (see the module docstring)."""
        sticky = self._sticky
        rep = sticky.get(request_id)
        if rep is not None:
            if rep._slot >= 0:
                sticky.move_to_end(request_id)
                self._take(rep._slot)
                return rep
            del sticky[request_id]
        routable = self._routable
        if not routable:
            raise NoReplicaError("no routable replica")
        scores = self.fills()
        low = min(scores)
        tied = [i for i, score in enumerate(scores) if score == low]
        if len(tied) == 1:
            slot = tied[0]
        elif self.deterministic:
            slot = tied[zlib.crc32(request_id.encode()) % len(tied)]
        else:
            self._rr = k = (self._rr + 1) % len(tied)
            slot = tied[k]
        self._take(slot)
        rep = routable[slot]
        sticky[request_id] = rep
        if len(sticky) > self.sticky_size:
            sticky.popitem(last=False)
        return rep

    def fills(self) -> list[float]:
        """`routing="load"`'s rank of each routable replica, lowest first (`workers.llm.fill`)."""
        return fills(self._routable, self._inflight, time.monotonic() - self.load_ttl_s)

    def _take(self, slot: int) -> None:
        """One more request in flight on `slot` (and since its replica's report)."""
        inflight = self._inflight
        c = inflight[slot]
        inflight[slot] = c + 1
        self._routable[slot].since += 1
        if c == self._low:  # keep `_low`/`_nlow` exact for `release` and `stats`
            if self._nlow == 1:
                self._low = c + 1
                self._nlow = inflight.count(c + 1)
            else:
                self._nlow -= 1

    def _acquire_round_robin(self) -> Replica:
        inflight = self._inflight
        if not inflight:
            raise NoReplicaError("no routable replica")
        slot = self._rr % len(inflight)
        self._rr = slot + 1
        self._take(slot)
        return self._routable[slot]

    # ---- membership (rare; rebuilds the routable lists) -----------------------------------

    def add_replicas(self, replicas: Iterable[Replica]) -> list[Replica]:
        """Add replicas (or update the address of known ids); returns the ones newly added.
        A replica of another role than the balancer's is left out (logged), and a known id that
        comes back under another role is removed."""
        added: list[Replica] = []
        for rep in replicas:
            if rep.role != self.role:
                logger.info(
                    "replica %s serves role %s, not %s: not routed to",
                    rep.replica_id,
                    rep.role,
                    self.role,
                )
                self.remove_replicas([rep.replica_id])
                continue
            old = self._known.get(rep.replica_id)
            if old is not None:
                if old.address != rep.address:
                    logger.info(
                        "replica %s moved %s -> %s", rep.replica_id, old.address, rep.address
                    )
                    old.address = rep.address
                continue
            self._known[rep.replica_id] = rep
            added.append(rep)
        if added:
            self._rebuild()
            logger.info("replicas added: %s", [r.replica_id for r in added])
        return added

    def remove_replicas(self, replicas: Iterable[Replica | str]) -> list[Replica]:
        """Forget replicas (by object or id); in-flight requests on them may still be released."""
        removed: list[Replica] = []
        for item in replicas:
            rid = item if isinstance(item, str) else item.replica_id
            rep = self._known.pop(rid, None)
            if rep is not None:
                removed.append(rep)
        if removed:
            self._rebuild(leaving=removed)
            logger.info("replicas removed: %s", [r.replica_id for r in removed])
        return removed

    def mark_unhealthy(self, replica: Replica | str) -> bool:
        """Stop routing to a replica (kept known, so `mark_healthy` brings it back).

        Returns True when this call changed its state.
        """
        rep = self._lookup(replica)
        if rep is None or not rep.healthy:
            return False
        rep.healthy = False
        self._rebuild()
        logger.warning("replica %s marked unhealthy", rep.replica_id)
        return True

    def mark_healthy(self, replica: Replica | str) -> bool:
        """Route to a known replica again. Returns True when this call changed its state."""
        rep = self._lookup(replica)
        if rep is None or rep.healthy:
            return False
        rep.healthy = True
        self._rebuild()
        logger.info("replica %s healthy again", rep.replica_id)
        return True

    # ---- inspection ------------------------------------------------------------------------

    def get(self, replica_id: str) -> Replica | None:
        return self._known.get(replica_id)

    def replicas(self) -> list[Replica]:
        """All known replicas, healthy or not, in replica-id order."""
        return sorted(self._known.values(), key=lambda r: r.replica_id)

    def routable(self) -> list[Replica]:
        """Replicas that `acquire` may return now, in replica-id order."""
        return list(self._routable)

    def inflight(self, replica: Replica | str) -> int:
        rep = self._lookup(replica) if isinstance(replica, str) else replica
        if rep is None:
            return 0
        return self._inflight[rep._slot] if rep._slot >= 0 else rep._inflight

    def sticky_replica(self, request_id: str) -> str | None:
        """The replica id `request_id` is pinned to, if any (does not touch LRU order)."""
        rep = self._sticky.get(request_id)
        return rep.replica_id if rep is not None else None

    def forget(self, request_id: str) -> None:
        """Drop the sticky entry of a finished session."""
        self._sticky.pop(request_id, None)

    def stats(self) -> dict[str, object]:
        return {
            "replicas": len(self._known),
            "routable": len(self._routable),
            "sticky_entries": len(self._sticky),
            "inflight": {r.replica_id: self.inflight(r) for r in self.replicas()},
            "reported_load": {r.replica_id: r.load for r in self.replicas()},
            "reported_capacity": {r.replica_id: r.capacity for r in self.replicas()},
        }

    # ---- internals -------------------------------------------------------------------------

    def _lookup(self, replica: Replica | str) -> Replica | None:
        rid = replica if isinstance(replica, str) else replica.replica_id
        return self._known.get(rid)

    def _rebuild(self, leaving: Iterable[Replica] = ()) -> None:
        for slot, rep in enumerate(self._routable):
            rep._inflight = self._inflight[slot]
            rep._slot = -1
        for rep in leaving:
            rep._slot = -1
        routable = sorted(
            (r for r in self._known.values() if r.healthy), key=lambda r: r.replica_id
        )
        for slot, rep in enumerate(routable):
            rep._slot = slot
        self._routable = routable
        self._inflight = [r._inflight for r in routable]
        self._low = min(self._inflight, default=0)
        self._nlow = self._inflight.count(self._low)
