"""The contract adapter: an aiohttp app that serves the replica contract in front of vLLM.

Invariants:
- Every response carries the policy version current when its request was *sent* to vLLM, and
  that is the only version its tokens came from: a version changes only inside
  `update_weights`, which first closes the gate (new requests wait here, not inside vLLM),
  aborts everything in flight and waits until nothing is (`_drain`). So no request ever runs
  across two weight versions; one aborted by the update comes back with the old version.
- Pause = gate closed + vLLM `/pause?mode=abort` (when dev mode has it) + `_drain`. Requests
  that arrive while paused wait in the adapter and run after `/resume`.
- Abort asks vLLM (`/abort_requests` with engine ids), which returns the tokens generated so
  far with finish "abort". Where vLLM lacks that endpoint, or a request outlives
  `drain_timeout_s` after its abort, the upstream HTTP request is cancelled instead (vLLM
  aborts on client disconnect) and the caller gets finish "abort" with no tokens.
- A failed weight load leaves the replica unhealthy (`/health` 503) until a load succeeds;
  a broadcast that did not arrive (`WeightTransferError`, 400) loaded nothing and does not.
- Started to await broadcast weights, it holds every request at the gate and answers 503
  `awaiting_weights` until its first load succeeds.
- Load (`LOAD_HEADER` on every response, `load` in /health, `rollout_replica_load`) is the
  adapter's own count, requests held at its gate + sent to vLLM and not answered: every request
  passes here, so it is exact and free (vLLM's running/waiting gauges lag a stats interval, cost
  a round trip and miss the held ones). Capacity (`CAPACITY_HEADER`): vLLM's resolved
  `max_num_seqs` × data-parallel size, read once at start; not reported where vLLM lacks it.
- Routed experts are served only when vLLM was started to return them (`num_experts` given:
  `return_routed_experts` in `VLLMReplicaConfig`); a request that asks for them otherwise gets
  400 with the reason, never a response without them. Responses to requests that did not ask
  drop vLLM's routing (it returns it for every request once on).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from workers.llm.contract import (
    CAPACITY_HEADER,
    LOAD_HEADER,
    CompletionRequest,
    ReplicaStatus,
    UpdateWeightsRequest,
)
from workers.llm.replicas.exceptions import WeightTransferError
from workers.llm.replicas.vllm_mapping import (
    VLLMUpstreamError,
    aborted_response,
    capacity_from_server_info,
    engine_request_id,
    from_vllm_completion,
    map_vllm_error,
    parse_vllm_metrics,
    render_replica_metrics,
    to_vllm_completion,
)
from workers.llm.replicas.vllm_upstream import UPSTREAM_ERRORS, VLLMUpstream

__all__ = ["VLLMAdapter"]

logger = logging.getLogger("rollout.replica.vllm")


@dataclass
class _InFlight:
    """One request sent to vLLM and not yet answered."""

    contract_id: str | None
    upstream_id: str
    task: asyncio.Task[tuple[int, Any]]
    engine_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.engine_id = engine_request_id(self.upstream_id)


_NO_ROUTING = (
    "return_routed_experts: this vLLM replica does not return routing (start it with "
    "--routed-experts, for a Mixture-of-Experts model on a vLLM build with model runner V2)"
)


def _error(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": err_type}}, status=status)


class VLLMAdapter:
    """Serves the contract on top of one vLLM server at `upstream_url`."""

    def __init__(
        self,
        *,
        upstream_url: str,
        replica_id: str,
        served_model_name: str,
        initial_version: int = 0,
        drain_timeout_s: float = 30.0,
        num_experts: int | None = None,
        await_weights: bool = False,
        receivers: int = 1,
    ) -> None:
        self.upstream = VLLMUpstream(upstream_url)
        # Broadcast weights: serve nothing until the trainer's arrive (gate closed till then);
        # `receivers`: the workers that receive them (tp × pp × dp), said in /health.
        self.awaiting, self.receivers = await_weights, receivers
        self.num_experts = num_experts  # experts per MoE layer when vLLM returns routing
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
        self._inflight: dict[str, _InFlight] = {}
        self._held = 0  # requests waiting at the closed gate
        self.capacity: int | None = None  # requests vLLM runs at once, once known
        self._background: set[asyncio.Task[None]] = set()

    @property
    def load(self) -> int:
        """Requests in this replica: held at the gate or in vLLM (the module docstring)."""
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
        """Wait for vLLM to answer /health; False if it did not in time or its process died."""
        max_len = await self.upstream.wait_healthy(child_alive, timeout_s)
        if max_len is None:
            return False
        self.capacity = capacity_from_server_info(await self.upstream.server_info())
        if self.capacity is None:
            logger.warning("vLLM does not say its max_num_seqs; capacity not reported")
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
            return _error(400, str(exc), "invalid_request_error")
        if req.return_routed_experts and self.num_experts is None:
            return _error(400, _NO_ROUTING, "invalid_request_error")
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
        upstream_id = f"{req.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        body = to_vllm_completion(req, model=self.served_model_name, upstream_id=upstream_id)
        task = asyncio.create_task(self.upstream.request("POST", "/v1/completions", json=body))
        self._inflight[upstream_id] = _InFlight(req.request_id, upstream_id, task)
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._inflight.pop(upstream_id, None)
        want_logprobs = req.logprobs is not None
        if task.cancelled():
            resp = aborted_response(
                request_id=req.request_id or upstream_id,
                model=self.served_model_name,
                created=int(time.time()),
                policy_version=version,
                want_logprobs=want_logprobs,
            )
            return web.json_response(resp.model_dump(mode="json"))
        try:
            status, data = task.result()
        except UPSTREAM_ERRORS as exc:
            return _error(502, f"vLLM unreachable: {exc}", "service_unavailable")
        if status != 200:
            return web.json_response(map_vllm_error(status, data), status=status)
        try:
            resp = from_vllm_completion(
                data,
                policy_version=version,
                want_logprobs=want_logprobs,
                request_id=req.request_id,
                num_experts=self.num_experts if req.return_routed_experts else None,
            )
        except (VLLMUpstreamError, ValidationError, TypeError, ValueError, AttributeError) as exc:
            logger.error("vLLM response breaks the contract: %s", exc)
            return _error(502, str(exc), "internal_error")
        return web.json_response(resp.model_dump(mode="json"))

    # ---------------------------------------------------------------- abort / pause

    async def _abort(self, entries: list[_InFlight]) -> None:
        """Ask vLLM to abort `entries`; cancel the HTTP request where it cannot."""
        live = [e for e in entries if not e.task.done()]
        if not live:
            return  # never send an empty list: vLLM reads it as "abort everything"
        try:
            ids = [e.engine_id for e in live]
            result = await self.upstream.dev("/abort_requests", json={"request_ids": ids})
        except UPSTREAM_ERRORS as exc:
            logger.warning("vLLM /abort_requests failed (%s); dropping the connections", exc)
            result = None
        if result is None:
            for e in live:
                e.task.cancel()

    async def _cancel_stragglers(self, entries: list[_InFlight], grace_s: float) -> None:
        tasks = [e.task for e in entries if not e.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                logger.warning("a request outlived its abort by %.0fs; dropping it", grace_s)
                task.cancel()

    async def _drain(self, settle_s: float = 0.0) -> None:
        """Abort everything in flight and wait until nothing is.

        `settle_s`: first give requests that vLLM already aborted (its `/pause`) that long to
        come back on their own, so none loses its partial tokens to a dropped connection.
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
            paused_upstream = (
                await self.upstream.dev("/pause", params={"mode": "abort"}) is not None
            )
        except UPSTREAM_ERRORS as exc:
            # The gate and the per-request aborts below still pause the replica.
            logger.warning("vLLM /pause failed (%s); aborting request by request", exc)
        await self._drain(settle_s=min(2.0, self.drain_timeout_s) if paused_upstream else 0.0)

    async def resume(self) -> None:
        await self.upstream.dev("/resume")
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
            return _error(400, f"pause mode {mode!r} is not supported", "invalid_request_error")
        await asyncio.shield(self.pause())  # a caller hanging up must not stop it halfway
        return web.json_response({"status": "paused"})

    async def handle_resume(self, _request: web.Request) -> web.Response:
        if self._update_lock.locked() or self.awaiting:
            return _error(409, "a weight update is in progress or awaited", "conflict")
        try:
            await asyncio.shield(self.resume())
        except UPSTREAM_ERRORS as exc:
            return _error(502, f"resume failed: {exc}", "internal_error")
        return web.json_response({"status": "resumed"})

    async def handle_is_paused(self, _request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    # ---------------------------------------------------------------- weights

    async def update_weights(
        self, path: str, version: int, grant: dict[str, Any] | None = None
    ) -> None:
        """Pause (abort all), load `path` (or receive the trainer's `grant`), reset the prefix
        cache, set `version`, resume (also a replica that awaited its first weights)."""
        async with self._update_lock:
            was_paused = self.paused and not self.awaiting
            try:
                await self.pause()
                started = time.monotonic()
                if grant is None:
                    reports = await self.upstream.reload_weights(path)
                else:
                    reports = await self.upstream.receive_weights(grant)
                    if failed := [str(r["error"]) for r in reports if r.get("error")]:
                        raise WeightTransferError(f"transfer failed: {failed[0]}")
                    path = f"broadcast {grant.get('address')}"
                # KV computed by the old weights must never be reused by the new ones.
                if await self.upstream.dev("/reset_prefix_cache") is None:
                    logger.warning("vLLM has no /reset_prefix_cache; relying on /pause to clear it")
                self.version, self.weights_error, self.awaiting = version, None, False
                logger.info(
                    "loaded weights version=%d from %s in %.1fs (%d workers; tied layers "
                    "reprocessed: %s)",
                    version,
                    path,
                    time.monotonic() - started,
                    len(reports),
                    sorted({name for r in reports for name in r.get("reprocessed", [])}),
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
            return _error(400, str(exc), "invalid_request_error")
        if req.transfer is None and not Path(req.path).is_dir():
            return _error(
                400, f"checkpoint directory {req.path!r} not found", "invalid_request_error"
            )
        try:
            # Shielded: a trainer that times out must not leave a half-done update behind.
            await asyncio.shield(self.update_weights(req.path, req.version, req.transfer))
        except WeightTransferError as exc:
            return _error(400, str(exc), exc.type)
        except UPSTREAM_ERRORS as exc:
            logger.error("weight update failed: %s", exc)
            return _error(500, str(exc), "internal_error")
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
            return web.json_response(body, status=503)
        body = {"status": "ok", "version": self.version, "load": self.load}
        if self.receivers > 1:  # the controller assumes one receiving process otherwise
            body["receivers"] = self.receivers
        if self.capacity is not None:
            body["capacity"] = self.capacity
        return web.json_response(body)

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        try:
            metrics = parse_vllm_metrics(await self.upstream.metrics_text())
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            return web.Response(status=503, text=f"vLLM metrics unavailable: {exc}\n")
        payload = render_replica_metrics(
            metrics,
            replica_id=self.replica_id,
            policy_version=self.version,
            load=self.load,
            capacity=self.capacity,
        )
        return web.Response(body=payload, content_type="text/plain", charset="utf-8")

    async def handle_info(self, _request: web.Request) -> web.Response:
        running = waiting = 0
        try:
            metrics = parse_vllm_metrics(await self.upstream.metrics_text())
            running, waiting = int(metrics.running), int(metrics.waiting)
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            logger.debug("no vLLM metrics for /info: %s", exc)
        status = ReplicaStatus(
            replica_id=self.replica_id,
            backend="vllm",
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
            return _error(502, f"vLLM unreachable: {exc}", "service_unavailable")
        return web.json_response(body, status=status)
