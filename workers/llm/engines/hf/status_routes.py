"""The status endpoints both `hf` apps (generation and `/classify`) serve alike.

    GET /health    the app's own handler (its body is the app's)
    GET /info      likewise
    GET /metrics   the app's registry as Prometheus text, rendered at scrape time

Each app passes a registry of its own, so several replicas in one process never share or clash
on metrics; collectors in it read their engine's live counters when `/metrics` is scraped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = ["Handler", "add_status_routes"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_status_routes(
    app: web.Application, *, health: Handler, info: Handler, registry: CollectorRegistry
) -> None:
    """Register `/health` and `/info` with these handlers, and `/metrics` over `registry`."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", metrics)
