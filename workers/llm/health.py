"""Replica health: `/health` probes that take replicas out of routing and bring them back.

Contract:
    - `check_all()` probes every known replica once, concurrently. `failures` consecutive failed
      probes mark a replica unhealthy in the balancer; one success marks it healthy again and
      calls `on_routable` (so waiters for a replica wake up). A replica removed or replaced
      while being probed is left alone.
    - `check_after_failure(rep)` is the fast path after a failed request: a single failed probe
      takes the replica out at once (the request failing too is the second witness).
    - Probes never raise: any transport error, non-200 or bad JSON counts as "not healthy".
    - A probe that answers records the replica's policy `version` on the `Replica`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import aiohttp
import orjson

from workers.llm.balancer import Balancer, Replica

__all__ = ["HealthChecker"]

logger = logging.getLogger("rollout.llm.health")


@dataclass(eq=False)
class HealthChecker:
    """Probes replicas over a shared aiohttp session and updates a `Balancer`.

    `session` is the client's, set when it opens (until then every probe fails);
    `consecutive` counts each replica's failed probes in a row.
    """

    balancer: Balancer
    _: KW_ONLY
    timeout_s: float
    failures: int
    on_routable: Callable[[], None] = lambda: None
    session: aiohttp.ClientSession | None = field(default=None, init=False)
    consecutive: dict[str, int] = field(default_factory=dict, init=False)
    timeout: aiohttp.ClientTimeout = field(init=False)

    def __post_init__(self) -> None:
        self.timeout = aiohttp.ClientTimeout(total=self.timeout_s)

    async def get_json(self, rep: Replica, path: str) -> dict[str, Any] | None:
        """GET a small JSON endpoint of `rep`; None on any failure."""
        if self.session is None or self.session.closed:
            return None
        try:
            async with self.session.get(f"{rep.address}{path}", timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                data = orjson.loads(await resp.read())
                return data if isinstance(data, dict) else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return None

    async def is_paused(self, rep: Replica) -> bool:
        data = await self.get_json(rep, "/is_paused")
        return bool(data and data.get("is_paused"))

    async def probe(self, rep: Replica) -> bool:
        data = await self.get_json(rep, "/health")
        if not data or data.get("status") != "ok":
            return False
        if isinstance(data.get("version"), int):
            rep.version = data["version"]
        if isinstance(data.get("load"), int):  # keeps the load fresh between responses
            capacity = data.get("capacity")
            self.balancer.report(rep, data["load"], capacity if isinstance(capacity, int) else None)
        return True

    async def check_after_failure(self, rep: Replica) -> None:
        if rep.routable and not await self.probe(rep):
            self.balancer.mark_unhealthy(rep)

    async def check_all(self) -> dict[str, bool]:
        """Probe every known replica once and update routing; returns replica id -> healthy."""
        reps = self.balancer.replicas()
        results = await asyncio.gather(*(self.probe(r) for r in reps))
        for rep, ok in zip(reps, results, strict=True):
            if self.balancer.get(rep.replica_id) is not rep:
                continue  # removed (or replaced) while probing
            if ok:
                self.consecutive[rep.replica_id] = 0
                if self.balancer.mark_healthy(rep):
                    self.on_routable()
            else:
                n = self.consecutive.get(rep.replica_id, 0) + 1
                self.consecutive[rep.replica_id] = n
                if n >= self.failures:
                    self.balancer.mark_unhealthy(rep)
        return {r.replica_id: ok for r, ok in zip(reps, results, strict=True)}

    async def run(self, interval_s: float) -> None:
        """Probe forever, every `interval_s` seconds (cancel the task to stop)."""
        while True:
            try:
                await self.check_all()
            except Exception:  # the loop must outlive any one bad round; it is logged
                logger.exception("health check round failed")
            await asyncio.sleep(interval_s)

    def forget(self, replica_id: str) -> None:
        self.consecutive.pop(replica_id, None)
