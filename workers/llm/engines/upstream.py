"""A thin async HTTP client of one inference server behind a contract adapter.

What every server the adapters front (vLLM, SGLang) shares: one aiohttp session without a
connection cap (thousands of generations may be in flight at once) whose idle connections
live shorter than the server keeps them (`KEEPALIVE_S`), `/health` polled until it
answers 200, `max_model_len` from `/v1/models`, `/server_info` read once for the capacity, and
`/metrics` as Prometheus text. Each backend's subclass names its engine, its error class and
the calls only it has (`vllm/upstream.py`, `sglang/upstream.py`).

Errors: `UPSTREAM_ERRORS` is everything a call may raise when the server is unreachable, slow
or answers what it should not: the adapters catch exactly that tuple.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import aiohttp

from workers.llm.engines.exceptions import UpstreamError

__all__ = [
    "CONTROL_TIMEOUT",
    "INFO_TIMEOUT",
    "KEEPALIVE_S",
    "SLOW_TIMEOUT",
    "UPSTREAM_ERRORS",
    "Upstream",
    "UpstreamError",
]

CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=30)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=120)
SLOW_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)

#: Seconds an idle pooled connection to the server may be reused. Both servers run on uvicorn
#: and close a keep-alive connection idle for 5 s (vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`,
#: SGLang's fixed `timeout_keep_alive`). aiohttp keeps one for 15 s, so a POST could go out on a
#: connection the server was closing, or had closed while this gate was too busy to notice, and
#: fail with "Server disconnected" (aiohttp retries only idempotent methods): a generation
#: answered 502 after an idle spell, a weight update's pause among them. Dropped sooner than the
#: server drops it, a reused connection is one the server still keeps.
KEEPALIVE_S = 2.0


UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    aiohttp.ClientError,
    UpstreamError,
)


class Upstream:
    """HTTP calls to one server at `base_url`; open with `start()`, close with `close()`."""

    engine: ClassVar[str] = "the server"  # as messages name it: "vLLM", "SGLang"
    error: ClassVar[type[UpstreamError]] = UpstreamError
    #: Query parameters of `/server_info` (vLLM wants its config as JSON).
    server_info_params: ClassVar[dict[str, str] | None] = None

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self.log = logging.getLogger(f"rollout.replica.{self.engine.lower()}")

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout = SLOW_TIMEOUT,
        text: bool = False,
    ) -> tuple[int, Any]:
        """(status, decoded JSON, or text when not JSON or `text=True`)."""
        if self._session is None:
            raise RuntimeError(f"{type(self).__name__} used before start()")
        async with self._session.request(
            method, f"{self.base_url}{path}", json=json, params=params, timeout=timeout
        ) as resp:
            if text:
                return resp.status, await resp.text()
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, await resp.text()

    async def wait_healthy(self, alive: Callable[[], bool], timeout_s: float) -> int | None:
        """Poll /health until 200 and return max_model_len (0 if unknown); None on failure."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive():
            with contextlib.suppress(*UPSTREAM_ERRORS):
                status, _ = await self.request("GET", "/health", timeout=CONTROL_TIMEOUT)
                if status == 200:
                    return await self.max_model_len()
            await asyncio.sleep(1.0)
        return None

    async def max_model_len(self) -> int:
        status, models = await self.request("GET", "/v1/models", timeout=CONTROL_TIMEOUT)
        cards = models.get("data", []) if status == 200 and isinstance(models, dict) else []
        return max((int(c.get("max_model_len") or 0) for c in cards), default=0)

    async def server_info(self) -> Any:
        """The server's `/server_info`, or None where it is absent or failed."""
        try:
            status, body = await self.request(
                "GET", "/server_info", params=self.server_info_params, timeout=INFO_TIMEOUT
            )
        except UPSTREAM_ERRORS as exc:
            self.log.warning("%s /server_info failed: %s", self.engine, exc)
            return None
        return body if status == 200 else None

    async def healthy(self) -> str | None:
        """None when the server answers /health with 200, else why not."""
        try:
            status, _ = await self.request("GET", "/health", timeout=CONTROL_TIMEOUT)
        except UPSTREAM_ERRORS as exc:
            return f"{self.engine} unreachable: {exc}"
        return None if status == 200 else f"{self.engine} health {status}"

    async def metrics_text(self) -> str:
        status, text = await self.request("GET", "/metrics", timeout=CONTROL_TIMEOUT, text=True)
        if status != 200:
            raise self.error(f"{self.engine} /metrics answered {status}{self._metrics_hint}")
        return str(text)

    _metrics_hint: ClassVar[str] = ""  # appended to a failed /metrics (a flag it needs)
