"""The `sglang` contract adapter: an aiohttp app that serves the replica contract in front of
one SGLang server, through SGLang's native API (`/generate` with `input_ids`).

Invariants (the vllm adapter's, kept the same way; not yet run against SGLang, README
"SGLang"):
- Every response carries the policy version current when its request was *sent* to SGLang,
  and that is the only version its tokens came from: a version changes only inside
  `update_weights`, which first closes the gate (new requests wait here), pauses SGLang
  (`/pause_generation` mode abort: everything in flight is aborted) and waits until nothing
  is in flight (`_drain`). A request aborted by an update comes back with the old version.
- Pause = gate closed + `/pause_generation {"mode": "abort"}` + `_drain`; resume =
  `/continue_generation` + gate open. Requests that arrive while paused wait in the adapter.
- Abort asks SGLang (`/abort_request {"rid"}`), which returns the tokens generated so far with
  finish "abort". Where that call fails, or a request outlives `drain_timeout_s` after its
  abort, the upstream HTTP request is cancelled instead (SGLang aborts a non-streamed request
  whose client left) and the caller gets finish "abort" with no tokens.
- A failed weight load leaves the replica unhealthy (`/health` 503) until a load succeeds.
- Load (`LOAD_HEADER`) is the adapter's own count (held at its gate + sent and not answered);
  capacity (`CAPACITY_HEADER`) is SGLang's max running requests over its data-parallel ranks,
  read once at start.
- Weights come from disk (`/update_weights_from_disk`); a broadcast grant (`transfer`) is
  refused with 400: SGLang's NCCL update group is not wired to the trainer's (sglang_mapping).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import ClientTimeout, web
from pydantic import ValidationError

from workers.llm.contract import (
    CAPACITY_HEADER,
    LOAD_HEADER,
    CompletionRequest,
    ReplicaStatus,
    UpdateWeightsRequest,
)
from workers.llm.replicas.sglang_mapping import (
    SGLangUpstreamError,
    capacity_from_server_info,
    dropped_response,
    from_sglang_generate,
    map_sglang_error,
    parse_sglang_metrics,
    to_sglang_generate,
    update_from_disk_body,
    upstream_rid,
)
from workers.llm.replicas.sglang_upstream import UPSTREAM_ERRORS, SGLangUpstream
from workers.llm.replicas.vllm_mapping import render_replica_metrics

__all__ = ["SGLangAdapter"]

logger = logging.getLogger("rollout.replica.sglang")
# One weight load from disk, however large the model; the connection itself is quick.
_LOAD_TIMEOUT = ClientTimeout(total=1800.0, sock_connect=30)


@dataclass
class _InFlight:
    """One request sent to SGLang and not yet answered."""

    contract_id: str | None
    rid: str
    task: asyncio.Task[tuple[int, Any]]


def _error(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": err_type}}, status=status)


class SGLangAdapter:
    """Serves the contract on top of one SGLang server at `upstream_url`."""

    def __init__(
        self,
        *,
        upstream_url: str,
        replica_id: str,
        served_model_name: str,
        initial_version: int = 0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.upstream = SGLangUpstream(upstream_url)
        self.replica_id = replica_id
        self.served_model_name = served_model_name
        self.version = initial_version
        self.drain_timeout_s = drain_timeout_s
        self.max_model_len = 0
        self.ready = False
        self.weights_error: str | None = None
        self.paused = False
        self.capacity: int | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._inflight: dict[str, _InFlight] = {}
        self._held = 0  # requests waiting at the closed gate
        self._background: set[asyncio.Task[None]] = set()

    @property
    def load(self) -> int:
        return self._held + len(self._inflight)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_post("/abort_requests", self.handle_abort)
        app.router.add_post("/pause", self.handle_pause)
        app.router.add_post("/resume", self.handle_resume)
        app.router.add_get("/is_paused", self.handle_is_paused)
        app.router.add_post("/update_weights", self.handle_update_weights)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/info", self.handle_info)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_response_prepare.append(self._report_load)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        await self.upstream.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        for task in list(self._background):
            task.cancel()
        await self.upstream.close()

    async def wait_until_ready(self, child_alive: Any, timeout_s: float) -> bool:
        """Wait for SGLang to answer /health; False if it did not in time or its process died."""
        max_len = await self.upstream.wait_healthy(child_alive, timeout_s)
        if max_len is None:
            return False
        self.capacity = capacity_from_server_info(await self.upstream.server_info())
        if self.capacity is None:
            logger.warning("SGLang's /server_info does not say its max running requests")
        self.max_model_len, self.ready = max_len, True
        return True

    async def _report_load(self, _request: web.Request, response: web.StreamResponse) -> None:
        response.headers[LOAD_HEADER] = str(self.load)
        if self.capacity is not None:
            response.headers[CAPACITY_HEADER] = str(self.capacity)

    # ---------------------------------------------------------------- generation

    async def handle_completions(self, request: web.Request) -> web.Response:
        try:
            req = CompletionRequest.model_validate(await request.json())
        except ValueError as exc:  # JSON and pydantic validation errors
            return _error(400, str(exc), "invalid_request_error")
        if req.return_routed_experts:
            return _error(400, "the sglang backend returns no routing", "invalid_request_error")
        if not self._open.is_set():
            self._held += 1
            try:
                while not self._open.is_set():
                    await self._open.wait()
            finally:
                self._held -= 1
        # From here to the in-flight registration nothing awaits: a pause either sees this
        # request in flight or held it at the gate.
        version = self.version
        rid = upstream_rid(req.request_id)
        body = to_sglang_generate(req, rid=rid)
        task = asyncio.create_task(self.upstream.request("POST", "/generate", json=body))
        self._inflight[rid] = _InFlight(req.request_id, rid, task)
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._inflight.pop(rid, None)
        want_logprobs = req.logprobs is not None
        answer = {
            "request_id": req.request_id or rid,
            "model": self.served_model_name,
            "created": int(time.time()),
            "policy_version": version,
            "want_logprobs": want_logprobs,
        }
        if task.cancelled():
            return web.json_response(dropped_response(**answer).model_dump(mode="json"))
        try:
            status, data = task.result()
        except UPSTREAM_ERRORS as exc:
            return _error(502, f"SGLang unreachable: {exc}", "service_unavailable")
        if status != 200:
            return web.json_response(map_sglang_error(status, data), status=status)
        try:
            resp = from_sglang_generate(data, stop_token_ids=req.stop_token_ids, **answer)
        except (SGLangUpstreamError, ValidationError, TypeError, ValueError) as exc:
            logger.error("SGLang answer breaks the contract: %s", exc)
            return _error(502, str(exc), "internal_error")
        return web.json_response(resp.model_dump(mode="json"))

    # ---------------------------------------------------------------- abort / pause

    async def _abort(self, entries: list[_InFlight]) -> None:
        """Ask SGLang to abort `entries` (one rid a call); cancel the HTTP request where the
        call fails."""
        live = [e for e in entries if not e.task.done()]

        async def one(entry: _InFlight) -> None:
            try:
                await self.upstream.request("POST", "/abort_request", json={"rid": entry.rid})
            except UPSTREAM_ERRORS as exc:
                logger.warning("SGLang /abort_request failed (%s); dropping the connection", exc)
                entry.task.cancel()

        await asyncio.gather(*(one(e) for e in live))

    async def _cancel_stragglers(self, entries: list[_InFlight], grace_s: float) -> None:
        tasks = [e.task for e in entries if not e.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                logger.warning("a request outlived its abort by %.0fs; dropping it", grace_s)
                task.cancel()

    async def _drain(self, settle_s: float = 0.0) -> None:
        """Abort everything in flight and wait until nothing is; `settle_s`: first give the
        requests SGLang's pause already aborted that long to come back with their tokens."""
        deadline = time.monotonic() + self.drain_timeout_s
        if self._inflight and settle_s > 0:
            await asyncio.wait([e.task for e in self._inflight.values()], timeout=settle_s)
        while self._inflight:
            entries = list(self._inflight.values())
            await self._abort(entries)
            left = deadline - time.monotonic()
            if left <= 0:
                await self._cancel_stragglers(entries, 0.0)
                await asyncio.sleep(0.05)  # let the cancelled handlers unregister
                continue
            await asyncio.wait([e.task for e in entries], timeout=min(1.0, left))

    async def pause(self) -> None:
        self._open.clear()
        self.paused = True
        paused_upstream = False
        try:
            await self.upstream.control("/pause_generation", {"mode": "abort"})
            paused_upstream = True
        except UPSTREAM_ERRORS as exc:
            # The gate and the per-request aborts below still pause the replica.
            logger.warning("SGLang /pause_generation failed (%s); aborting one by one", exc)
        await self._drain(settle_s=min(2.0, self.drain_timeout_s) if paused_upstream else 0.0)

    async def resume(self) -> None:
        await self.upstream.control("/continue_generation", {})
        self.paused = False
        self._open.set()

    async def handle_abort(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError as exc:
            return _error(400, f"invalid JSON: {exc}", "invalid_request_error")
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return _error(400, "request_ids must be a list of strings", "invalid_request_error")
        wanted = set(ids or [])  # empty or missing: all
        entries = [e for e in self._inflight.values() if not wanted or e.contract_id in wanted]
        await self._abort(entries)
        task = asyncio.create_task(self._cancel_stragglers(entries, self.drain_timeout_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return web.json_response({"status": "aborted", "aborted": len(entries)})

    async def handle_pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode != "abort":
            return _error(400, f"pause mode {mode!r} is not supported", "invalid_request_error")
        await asyncio.shield(self.pause())  # a caller hanging up must not stop it halfway
        return web.json_response({"status": "paused"})

    async def handle_resume(self, _request: web.Request) -> web.Response:
        if self._update_lock.locked():
            return _error(409, "a weight update is in progress", "conflict")
        try:
            await asyncio.shield(self.resume())
        except UPSTREAM_ERRORS as exc:
            return _error(502, f"resume failed: {exc}", "internal_error")
        return web.json_response({"status": "resumed"})

    async def handle_is_paused(self, _request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    # ---------------------------------------------------------------- weights

    async def update_weights(self, path: str, version: int) -> None:
        """Pause (abort all), load `path` (SGLang flushes its prefix cache), set `version`,
        resume."""
        async with self._update_lock:
            was_paused = self.paused
            try:
                await self.pause()
                started = time.monotonic()
                await self.upstream.control(
                    "/update_weights_from_disk",
                    update_from_disk_body(path, version),
                    timeout=_LOAD_TIMEOUT,
                )
                self.version, self.weights_error = version, None
                logger.info(
                    "loaded weights version=%d from %s in %.1fs",
                    version,
                    path,
                    time.monotonic() - started,
                )
            except BaseException as exc:
                self.weights_error = f"weight update to version {version} failed: {exc}"
                raise
            finally:
                if not was_paused:
                    await self.resume()

    async def handle_update_weights(self, request: web.Request) -> web.Response:
        try:
            req = UpdateWeightsRequest.model_validate(await request.json())
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if not req.path:
            return _error(
                400, "the sglang backend loads weights from a path only", "invalid_request_error"
            )
        if not Path(req.path).is_dir():
            return _error(
                400, f"checkpoint directory {req.path!r} not found", "invalid_request_error"
            )
        try:
            # Shielded: a trainer that times out must not leave a half-done update behind.
            await asyncio.shield(self.update_weights(req.path, req.version))
        except UPSTREAM_ERRORS as exc:
            logger.error("weight update failed: %s", exc)
            return _error(500, str(exc), "internal_error")
        return web.json_response({"status": "ok", "version": self.version})

    # ---------------------------------------------------------------- status

    async def handle_health(self, _request: web.Request) -> web.Response:
        reason = "starting" if not self.ready else self.weights_error
        if reason is None:
            reason = await self.upstream.healthy()
        if reason is not None:
            body = {"status": "unavailable", "version": self.version, "reason": reason}
            return web.json_response(body, status=503)
        body = {"status": "ok", "version": self.version, "load": self.load}
        if self.capacity is not None:
            body["capacity"] = self.capacity
        return web.json_response(body)

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        try:
            counters = parse_sglang_metrics(await self.upstream.metrics_text())
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            return web.Response(status=503, text=f"SGLang metrics unavailable: {exc}\n")
        # The contract's families, rendered as the vllm backend renders them (any backend's
        # `ReplicaCounters` fit).
        payload = render_replica_metrics(
            counters,  # type: ignore[arg-type]
            replica_id=self.replica_id,
            policy_version=self.version,
            load=self.load,
            capacity=self.capacity,
        )
        return web.Response(body=payload, content_type="text/plain", charset="utf-8")

    async def handle_info(self, _request: web.Request) -> web.Response:
        running = waiting = 0
        try:
            counters = parse_sglang_metrics(await self.upstream.metrics_text())
            running, waiting = int(counters.running), int(counters.waiting)
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            logger.debug("no SGLang metrics for /info: %s", exc)
        status = ReplicaStatus(
            replica_id=self.replica_id,
            backend="sglang",
            model=self.served_model_name,
            version=self.version,
            max_model_len=self.max_model_len,
            is_paused=self.paused,
            running=running,
            waiting=waiting,
        )
        return web.json_response(status.model_dump(mode="json"))

    async def handle_models(self, _request: web.Request) -> web.Response:
        try:
            status, body = await self.upstream.request("GET", "/v1/models")
        except UPSTREAM_ERRORS as exc:
            return _error(502, f"SGLang unreachable: {exc}", "service_unavailable")
        return web.json_response(body, status=status)
