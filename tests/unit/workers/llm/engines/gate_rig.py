"""A gate adapter (vLLM's or SGLang's) in front of a fake engine of that backend, each on an
aiohttp test server: what the adapter tests of both backends stand on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from workers.llm.engines.gate import GatedAdapter


@dataclass
class Rig:
    fake: Any
    adapter: Any
    client: TestClient

    async def complete(self, **kw: Any) -> tuple[int, dict[str, Any]]:
        resp = await self.client.post("/v1/completions", json={"prompt": [1, 2, 3]} | kw)
        return resp.status, await resp.json()

    async def until(self, cond: Any, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.01)


@asynccontextmanager
async def gate_rig(fake: Any, adapter: type[GatedAdapter], **settings: Any) -> AsyncIterator[Rig]:
    """`fake` served, an `adapter(upstream_url=its url, **settings)` in front of it and ready,
    a client of the adapter."""
    upstream = TestServer(fake.app())
    await upstream.start_server()
    gated = adapter(upstream_url=str(upstream.make_url("")), **settings)
    client = TestClient(TestServer(gated.app()))
    await client.start_server()
    try:
        assert await gated.wait_until_ready(lambda: True, 5.0)
        yield Rig(fake, gated, client)
    finally:
        await client.close()
        await upstream.close()
