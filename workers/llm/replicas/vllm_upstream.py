"""A thin async client of one vLLM OpenAI-compatible server (the adapter's upstream).

It knows vLLM's endpoint names and which ones this server lacks: a dev-mode endpoint that
answers 404 once is remembered as absent and never called again (`dev` returns None), so
the adapter can fall back (older vLLM, or dev mode off). Endpoints used, all under
`VLLM_SERVER_DEV_MODE=1` except the first three:
`/health`, `/v1/models`, `/metrics`, `/v1/completions`, `/abort_requests {request_ids}`,
`/pause?mode=abort`, `/resume`, `/reset_prefix_cache`, `/collective_rpc {method, args, kwargs}`,
`GET /server_info` (the resolved config, read once for the replica's capacity).

Weight reload from disk goes through `collective_rpc` to the project's worker extension
(`workers.llm.replicas.vllm_worker.WeightSync`, which the launcher always installs):
`rollout_load_weights(weights_path=...)`, vLLM's in-place `reload_weights` plus the tied-head
fix explained there; broadcast weights through `rollout_receive_weights(grant=...)`. There is
deliberately no fallback to a bare `reload_weights`: on a model with tied embeddings it would
answer 200 and serve a head of the previous version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from workers.llm.replicas.vllm_mapping import VLLMUpstreamError

__all__ = ["RECEIVE_METHOD", "UPSTREAM_ERRORS", "WEIGHT_SYNC_METHOD", "VLLMUpstream"]

logger = logging.getLogger("rollout.replica.vllm")

WEIGHT_SYNC_METHOD = "rollout_load_weights"  # WeightSync's method, called by name
RECEIVE_METHOD = "rollout_receive_weights"  # its broadcast twin (`trainer.weight_transfer`)
CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=30)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=120)
SLOW_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    aiohttp.ClientError,
    VLLMUpstreamError,
)


class VLLMUpstream:
    """HTTP calls to vLLM at `base_url`; open with `start()`, close with `close()`."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._has: dict[str, bool] = {}
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
        params: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout = SLOW_TIMEOUT,
        text: bool = False,
    ) -> tuple[int, Any]:
        """(status, decoded JSON, or text when not JSON or `text=True`)."""
        if self._session is None:
            raise RuntimeError("VLLMUpstream used before start()")
        url = f"{self.base_url}{path}"
        async with self._session.request(
            method, url, json=json, params=params, timeout=timeout
        ) as resp:
            if text:
                return resp.status, await resp.text()
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, await resp.text()

    async def dev(self, path: str, **kwargs: Any) -> tuple[int, Any] | None:
        """POST a dev-mode endpoint; None when this vLLM does not have it (404, remembered)."""
        if self._has.get(path) is False:
            return None
        status, body = await self.request("POST", path, **kwargs)
        if status == 404:
            logger.warning("vLLM has no %s; using the adapter's fallback", path)
            self._has[path] = False
            return None
        self._has[path] = True
        if status >= 400:
            raise VLLMUpstreamError(f"vLLM {path} answered {status}: {body!r:.300}")
        return status, body

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
        """vLLM's `/server_info` (JSON config), or None where it is absent or failed. Its
        first call also gathers vLLM's system report, which takes a few seconds."""
        try:
            status, body = await self.request(
                "GET", "/server_info", params={"config_format": "json"}, timeout=INFO_TIMEOUT
            )
        except UPSTREAM_ERRORS as exc:
            logger.warning("vLLM /server_info failed: %s", exc)
            return None
        return body if status == 200 else None

    async def healthy(self) -> str | None:
        """None when vLLM answers /health with 200, else why not."""
        try:
            status, _ = await self.request("GET", "/health", timeout=CONTROL_TIMEOUT)
        except UPSTREAM_ERRORS as exc:
            return f"vLLM unreachable: {exc}"
        return None if status == 200 else f"vLLM health {status}"

    async def metrics_text(self) -> str:
        status, text = await self.request("GET", "/metrics", timeout=CONTROL_TIMEOUT, text=True)
        if status != 200:
            raise VLLMUpstreamError(f"vLLM /metrics answered {status}")
        return str(text)

    async def reload_weights(self, path: str) -> list[dict[str, Any]]:
        """Load the checkpoint at `path` into every worker (the engine should be paused).

        Returns each worker's report (`WeightSync.rollout_load_weights`); raises
        `VLLMUpstreamError` when vLLM refuses or a worker did not report.
        """
        return await self._rpc(WEIGHT_SYNC_METHOD, {"weights_path": path})

    async def receive_weights(self, grant: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker receives the trainer's granted transfer and loads it (paused engine);
        each worker's report, as `reload_weights`."""
        return await self._rpc(RECEIVE_METHOD, {"grant": grant})

    async def _rpc(self, method: str, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        status, body = await self.request(
            "POST", "/collective_rpc", json={"method": method, "kwargs": kwargs}
        )
        if status != 200:
            raise VLLMUpstreamError(f"collective_rpc {method} answered {status}: {body!r:.300}")
        results = body.get("results") if isinstance(body, dict) else None
        if not results or not all(isinstance(r, dict) for r in results):
            raise VLLMUpstreamError(f"collective_rpc {method}: no reports: {body!r:.300}")
        return list(results)
