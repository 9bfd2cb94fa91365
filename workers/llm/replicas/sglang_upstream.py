"""A thin async client of one SGLang server (the `sglang` adapter's upstream).

Endpoints used (SGLang 0.5.23's http_server.py; none needs a special mode): `/health`,
`/v1/models` (`max_model_len`), `/server_info` (read once, for the capacity), `/metrics`
(with `--enable-metrics`), `/generate`, `/abort_request`, `/pause_generation`,
`/continue_generation`, `/update_weights_from_disk`. The shapes and what each means are in
`workers.llm.replicas.sglang_mapping`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from workers.llm.replicas.sglang_mapping import SGLangUpstreamError

__all__ = ["UPSTREAM_ERRORS", "SGLangUpstream"]

CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=30)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=120)
SLOW_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    aiohttp.ClientError,
    SGLangUpstreamError,
)


class SGLangUpstream:
    """HTTP calls to SGLang at `base_url`; open with `start()`, close with `close()`."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No connection cap: thousands of generations may be in flight at once.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

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
        timeout: aiohttp.ClientTimeout = SLOW_TIMEOUT,
        text: bool = False,
    ) -> tuple[int, Any]:
        """(status, decoded JSON, or text when not JSON or `text=True`)."""
        if self._session is None:
            raise RuntimeError("SGLangUpstream used before start()")
        async with self._session.request(
            method, f"{self.base_url}{path}", json=json, timeout=timeout
        ) as resp:
            if text:
                return resp.status, await resp.text()
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, await resp.text()

    async def control(
        self, path: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout = CONTROL_TIMEOUT
    ) -> Any:
        """POST a control endpoint; SGLangUpstreamError unless it answers 200 (and, where the
        body has one, `success: true`)."""
        status, answer = await self.request("POST", path, json=body, timeout=timeout)
        failed = isinstance(answer, dict) and answer.get("success") is False
        if status != 200 or failed:
            message = answer.get("message") if isinstance(answer, dict) else answer
            raise SGLangUpstreamError(f"SGLang {path} answered {status}: {message!r:.300}")
        return answer

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
        """SGLang's `/server_info`, or None where it failed."""
        try:
            status, body = await self.request("GET", "/server_info", timeout=INFO_TIMEOUT)
        except UPSTREAM_ERRORS:
            return None
        return body if status == 200 else None

    async def healthy(self) -> str | None:
        """None when SGLang answers /health with 200, else why not."""
        try:
            status, _ = await self.request("GET", "/health", timeout=CONTROL_TIMEOUT)
        except UPSTREAM_ERRORS as exc:
            return f"SGLang unreachable: {exc}"
        return None if status == 200 else f"SGLang health {status}"

    async def metrics_text(self) -> str:
        status, text = await self.request("GET", "/metrics", timeout=CONTROL_TIMEOUT, text=True)
        if status != 200:
            raise SGLangUpstreamError(f"SGLang /metrics answered {status} (--enable-metrics?)")
        return str(text)
