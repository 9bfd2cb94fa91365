"""The replica contract served in front of another inference server: the gate, the in-flight
registry, pause/abort/drain, weight updates and status, whatever the server (vLLM, SGLang).

Invariants (each backend's adapter keeps them by subclassing `GatedAdapter`):
- Every response carries the policy version current when its request was *sent* upstream,
  and that is the only version its tokens came from: a version changes only inside
  `update_weights`, which first closes the gate (new requests wait here, not upstream),
  aborts everything in flight and waits until nothing is (`_drain`). So no request ever runs
  across two weight versions; one aborted by the update comes back with the old version.
- Pause = gate closed + the server's own pause (`_pause_upstream`, aborting) + `_drain`.
  Requests that arrive while paused wait in the adapter and run after `/resume`.
- Abort asks the server (`_abort`), which answers the aborted request with the tokens so far
  and finish "abort". Where it cannot, or a request outlives `drain_timeout_s` after its
  abort, the upstream HTTP request is cancelled instead (the servers abort a request whose
  client left) and the caller gets finish "abort" with no tokens (`dropped_response`).
- A failed weight load leaves the replica unhealthy (`/health` 503) until a load succeeds; a
  broadcast that did not arrive (`WeightTransferError`, 400) loaded nothing and does not.
- Started to await broadcast weights, it holds every request at the gate and answers 503
  `awaiting_weights` until its first load succeeds.
- Load (`LOAD_HEADER` on every response, `load` in /health, `rollout_replica_load`) is the
  adapter's own count, requests held at its gate + sent upstream and not answered: every
  request passes here, so it is exact and free (the servers' running/waiting gauges lag a
  stats interval, cost a round trip and miss the held ones). Capacity (`CAPACITY_HEADER`):
  what the server says it runs at once, read once at start; not reported where it does not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from aiohttp import web
from pydantic import ValidationError

from workers.llm.contract import (
    CAPACITY_HEADER,
    LOAD_HEADER,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ReplicaStatus,
    UpdateWeightsRequest,
)
from workers.llm.engines.exceptions import UpstreamError
from workers.llm.engines.upstream import UPSTREAM_ERRORS, Upstream
from workers.metrics import ReplicaCounters, render_replica_metrics
from workers.weights.exceptions import WeightTransferError

__all__ = ["GatedAdapter", "InFlight", "dropped_response", "error_response"]

#: What a server's answer that breaks the contract raises while it is mapped.
_BROKEN_ANSWER = (UpstreamError, ValidationError, TypeError, ValueError, AttributeError)


@dataclass
class InFlight:
    """One request sent upstream and not yet answered."""

    contract_id: str | None
    upstream_id: str
    task: asyncio.Task[tuple[int, Any]]
    engine_id: str  # what the server's abort call names it by


def error_response(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": err_type}}, status=status)


def dropped_response(
    *, request_id: str, model: str, created: int, policy_version: int, want_logprobs: bool
) -> CompletionResponse:
    """An abort that reached the server only as a dropped connection: nothing came back."""
    choice = CompletionChoice(
        token_ids=[],
        logprobs={"token_logprobs": []} if want_logprobs else None,
        finish_reason="abort",
    )
    return CompletionResponse.one(
        choice,
        usage={"completion_tokens": 0},
        id=request_id,
        created=created,
        model=model,
        policy_version=policy_version,
    )


class GatedAdapter:
    """Serves the contract on top of one server; a subclass says how to talk to it."""

    backend: ClassVar[str]  # the contract's backend name: "vllm", "sglang"
    takes_images: ClassVar[bool] = False  # whether `_generate` passes a request's images on
    # The groups its processes can receive broadcast weights over (said in /health; the
    # trainer grants NCCL only to a replica that says it): none by default (SGLang).
    transfer_backends: ClassVar[tuple[str, ...]] = ()

    upstream_class: ClassVar[type[Upstream]]  # the client of its server

    def __init__(
        self,
        *,
        upstream_url: str,
        replica_id: str,
        served_model_name: str,
        initial_version: int = 0,
        drain_timeout_s: float = 30.0,
        await_weights: bool = False,
        receivers: int = 1,
        dtype: str | None = None,
    ) -> None:
        upstream = self.upstream = self.upstream_class(upstream_url)
        self.dtype = dtype  # the dtype it serves (said in /health; None: not known here)
        self.engine = upstream.engine
        self.log = logging.getLogger(f"rollout.replica.{self.backend}")
        # Broadcast weights: serve nothing until the trainer's arrive (gate closed till then);
        # `receivers`: the processes that receive them (tp × pp × dp), said in /health.
        self.awaiting, self.receivers = await_weights, receivers
        self.replica_id = replica_id
        self.served_model_name = served_model_name
        self.version = initial_version
        self.drain_timeout_s = drain_timeout_s
        self.max_model_len = 0
        self.ready = False
        self.weights_error: str | None = None
        self.paused = await_weights
        self._open = asyncio.Event()
        if not await_weights:
            self._open.set()
        self._update_lock = asyncio.Lock()
        self._inflight: dict[str, InFlight] = {}
        self._held = 0  # requests waiting at the closed gate
        self.capacity: int | None = None  # requests the server runs at once, once known
        self._background: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- what a backend says

    def _refuse(self, req: CompletionRequest) -> str | None:
        """Why this backend will not serve `req` (→ 400), or None."""
        return None

    def _upstream_id(self, req: CompletionRequest) -> str:
        raise NotImplementedError

    def _engine_id(self, req: CompletionRequest, upstream_id: str) -> str:
        """The name the server's abort call knows the request by."""
        return upstream_id

    def _generate(
        self, req: CompletionRequest, upstream_id: str
    ) -> Coroutine[Any, Any, tuple[int, Any]]:
        """The upstream call that generates `req` (status, body)."""
        raise NotImplementedError

    def _answer(self, req: CompletionRequest, data: Any, answer: dict[str, Any]) -> Any:
        """The contract's response from the server's 200 body; raises on a broken one."""
        raise NotImplementedError

    def _map_error(self, status: int, data: Any) -> dict[str, Any]:
        raise NotImplementedError

    async def _abort(self, entries: list[InFlight]) -> None:
        """Ask the server to abort `entries`; cancel the HTTP request where it cannot."""
        raise NotImplementedError

    async def _pause_upstream(self) -> bool:
        """Pause the server, aborting what it runs; False where it has no such call."""
        raise NotImplementedError

    async def _resume_upstream(self) -> None:
        raise NotImplementedError

    def _refuse_update(self, req: UpdateWeightsRequest) -> str | None:
        """Why this backend will not take the update `req` (→ 400), or None."""
        return None

    async def _load(self, path: str, version: int, grant: dict[str, Any] | None) -> str:
        """Load `path` (or receive `grant`) as `version` into the paused server, its prefix
        cache cleared; a few words for the log line."""
        raise NotImplementedError

    def _counters(self, metrics_text: str) -> ReplicaCounters:
        raise NotImplementedError

    def _capacity(self, server_info: Any) -> int | None:
        raise NotImplementedError

    # ---------------------------------------------------------------- the app

    @property
    def load(self) -> int:
        """Requests in this replica: held at the gate or upstream (the module docstring)."""
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
        """Wait for the server to answer /health; False if it did not in time or died."""
        max_len = await self.upstream.wait_healthy(child_alive, timeout_s)
        if max_len is None:
            return False
        self.capacity = self._capacity(await self.upstream.server_info())
        if self.capacity is None:
            self.log.warning("%s does not say how many requests it runs at once", self.engine)
        self.max_model_len, self.ready = max_len, True
        return True

    async def _report_load(self, _request: web.Request, response: web.StreamResponse) -> None:
        """Every response: the load, not counting the request it answers (it has left
        `_inflight` by then), and the capacity when known."""
        response.headers[LOAD_HEADER] = str(self.load)
        if self.capacity is not None:
            response.headers[CAPACITY_HEADER] = str(self.capacity)

    # ---------------------------------------------------------------- generation

    async def handle_completions(self, request: web.Request) -> web.Response:
        try:
            req = CompletionRequest.model_validate(await request.json())
        except ValueError as exc:  # JSON and pydantic validation errors
            return error_response(400, str(exc), "invalid_request_error")
        if req.images and not self.takes_images:  # never serve an image prompt on its
            # placeholder tokens alone (issue 32; README "Images")
            return error_response(
                400,
                f"images: the {self.backend} backend does not take images yet; serve a "
                "vision-language policy with the hf backend",
                "invalid_request_error",
            )
        if (refused := self._refuse(req)) is not None:
            return error_response(400, refused, "invalid_request_error")
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
        upstream_id = self._upstream_id(req)
        task = asyncio.create_task(self._generate(req, upstream_id))
        engine_id = self._engine_id(req, upstream_id)
        self._inflight[upstream_id] = InFlight(req.request_id, upstream_id, task, engine_id)
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._inflight.pop(upstream_id, None)
        answer = {
            "request_id": req.request_id or upstream_id,
            "model": self.served_model_name,
            "created": int(time.time()),
            "policy_version": version,
            "want_logprobs": req.logprobs is not None,
        }
        if task.cancelled():
            return web.json_response(dropped_response(**answer).model_dump(mode="json"))
        try:
            status, data = task.result()
        except UPSTREAM_ERRORS as exc:
            return error_response(502, f"{self.engine} unreachable: {exc}", "service_unavailable")
        if status != 200:
            return web.json_response(self._map_error(status, data), status=status)
        try:
            resp = self._answer(req, data, answer)
        except _BROKEN_ANSWER as exc:
            self.log.error("%s response breaks the contract: %s", self.engine, exc)
            return error_response(502, str(exc), "internal_error")
        return web.json_response(resp.model_dump(mode="json"))

    # ---------------------------------------------------------------- abort / pause

    async def _cancel_stragglers(self, entries: list[InFlight], grace_s: float) -> None:
        tasks = [e.task for e in entries if not e.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                self.log.warning("a request outlived its abort by %.0fs; dropping it", grace_s)
                task.cancel()

    async def _drain(self, settle_s: float = 0.0) -> None:
        """Abort everything in flight and wait until nothing is.

        `settle_s`: first give requests that the server already aborted (its pause) that long
        to come back on their own, so none loses its partial tokens to a dropped connection.
        """
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
            paused_upstream = await self._pause_upstream()
        except UPSTREAM_ERRORS as exc:
            # The gate and the per-request aborts below still pause the replica.
            self.log.warning("%s pause failed (%s); aborting one by one", self.engine, exc)
        await self._drain(settle_s=min(2.0, self.drain_timeout_s) if paused_upstream else 0.0)

    async def resume(self) -> None:
        await self._resume_upstream()
        self.paused = False
        self._open.set()

    async def handle_abort(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError as exc:
            return error_response(400, f"invalid JSON: {exc}", "invalid_request_error")
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return error_response(
                400, "request_ids must be a list of strings", "invalid_request_error"
            )
        wanted = set(ids or [])  # empty or missing: all, as vLLM does
        entries = [e for e in self._inflight.values() if not wanted or e.contract_id in wanted]
        await self._abort(entries)
        task = asyncio.create_task(self._cancel_stragglers(entries, self.drain_timeout_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return web.json_response({"status": "aborted", "aborted": len(entries)})

    async def handle_pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode != "abort":
            return error_response(
                400, f"pause mode {mode!r} is not supported", "invalid_request_error"
            )
        await asyncio.shield(self.pause())  # a caller hanging up must not stop it halfway
        return web.json_response({"status": "paused"})

    async def handle_resume(self, _request: web.Request) -> web.Response:
        if self._update_lock.locked() or self.awaiting:
            return error_response(409, "a weight update is in progress or awaited", "conflict")
        try:
            await asyncio.shield(self.resume())
        except UPSTREAM_ERRORS as exc:
            return error_response(502, f"resume failed: {exc}", "internal_error")
        return web.json_response({"status": "resumed"})

    async def handle_is_paused(self, _request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    # ---------------------------------------------------------------- weights

    async def update_weights(
        self, path: str, version: int, grant: dict[str, Any] | None = None
    ) -> None:
        """Pause (abort all), load `path` (or receive the trainer's `grant`) with the prefix
        cache cleared, set `version`, resume (also a replica that awaited its first weights)."""
        async with self._update_lock:
            was_paused = self.paused and not self.awaiting
            try:
                await self.pause()
                started = time.monotonic()
                detail = await self._load(path, version, grant)
                self.version, self.weights_error, self.awaiting = version, None, False
                source = path if grant is None else f"broadcast {grant.get('address')}"
                self.log.info(
                    "loaded weights version=%d from %s in %.1fs%s",
                    version,
                    source,
                    time.monotonic() - started,
                    detail,
                )
            except WeightTransferError:
                raise  # nothing was loaded: the weights served are whole
            except BaseException as exc:
                self.weights_error = f"weight update to version {version} failed: {exc}"
                raise
            finally:
                if not was_paused and not self.awaiting:
                    await self.resume()

    async def handle_update_weights(self, request: web.Request) -> web.Response:
        try:
            req = UpdateWeightsRequest.model_validate(await request.json())
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        if (refused := self._refuse_update(req)) is not None:
            return error_response(400, refused, "invalid_request_error")
        if req.transfer is None and not Path(req.path).is_dir():
            return error_response(
                400, f"checkpoint directory {req.path!r} not found", "invalid_request_error"
            )
        try:
            # Shielded: a trainer that times out must not leave a half-done update behind.
            await asyncio.shield(self.update_weights(req.path, req.version, req.transfer))
        except WeightTransferError as exc:
            return error_response(400, str(exc), exc.type)
        except UPSTREAM_ERRORS as exc:
            self.log.error("weight update failed: %s", exc)
            return error_response(500, str(exc), "internal_error")
        return web.json_response({"status": "ok", "version": self.version})

    # ---------------------------------------------------------------- status

    async def handle_health(self, _request: web.Request) -> web.Response:
        reason = "starting" if not self.ready else self.weights_error
        if reason is None:
            reason = "awaiting weights" if self.awaiting else await self.upstream.healthy()
        if reason is not None:
            body = {"status": "unavailable", "version": self.version, "reason": reason}
            if reason == "awaiting weights":
                body |= {"awaiting_weights": True, "receivers": self.receivers}
                body |= self._weights_info()
            return web.json_response(body, status=503)
        body = {"status": "ok", "version": self.version, "load": self.load}
        if self.receivers > 1:  # the controller assumes one receiving process otherwise
            body["receivers"] = self.receivers
        body |= self._weights_info()
        if self.capacity is not None:
            body["capacity"] = self.capacity
        return web.json_response(body)

    def _weights_info(self) -> dict[str, Any]:
        """What a weight-sync controller puts in its want: the dtype served (its weights
        travel in it) and the groups this replica can receive over."""
        info: dict[str, Any] = {"transfer_backends": list(self.transfer_backends)}
        if self.dtype is not None:
            info["dtype"] = self.dtype
        return info

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        try:
            counters = self._counters(await self.upstream.metrics_text())
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            return web.Response(status=503, text=f"{self.engine} metrics unavailable: {exc}\n")
        payload = render_replica_metrics(
            counters,
            replica_id=self.replica_id,
            policy_version=self.version,
            load=self.load,
            capacity=self.capacity,
        )
        return web.Response(body=payload, content_type="text/plain", charset="utf-8")

    async def handle_info(self, _request: web.Request) -> web.Response:
        running = waiting = 0
        try:
            counters = self._counters(await self.upstream.metrics_text())
            running, waiting = int(counters.running), int(counters.waiting)
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            self.log.debug("no %s metrics for /info: %s", self.engine, exc)
        status = ReplicaStatus(
            replica_id=self.replica_id,
            backend=self.backend,
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
            return error_response(502, f"{self.engine} unreachable: {exc}", "service_unavailable")
        return web.json_response(body, status=status)
