"""The `hf` replica: an aiohttp server around `HFEngine` that serves `workers.llm.contract`.

Started by `rollout replica serve --backend hf --model DIR --port P [--threads N]
[--max-batch B] [--prefix-cache-tokens T] ...`, the one command line (`pipeline.cli.stages`);
this module has none of its own. `create_app(...)` is the async app factory (tests and
in-process use); `serve(...)` runs it. Torch and transformers are imported only when an app is
created, so importing this module is cheap.

Invariants:
- Every JSON response but `/is_paused` (whose body the contract fixes to `{"is_paused"}`)
  carries `policy_version`: for a completion, the version of the weights that produced its
  tokens; elsewhere, the version served now.
- A request that cannot be served gets a 4xx (5xx for the server's own faults) with
  `{"error": {"message", "type"}}`; nothing a client sends stops the server.
- A client that disconnects mid-generation has its request aborted (handler cancellation).
- A replica started with `role="judge"` (serving another model than the policy: the reward
  stage's judge) says so in `/health` and `/info` and refuses `/update_weights` with 409:
  the policy's weights never reach it, whoever posts them.
- `/metrics` reads the engine's live counters at scrape time from a registry of this server's
  own, so several replicas in one process never share or clash on metrics; the names are
  `workers.metrics.replica_families`, the same for every backend.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from pydantic import ValidationError

from schemas.events import ReplicaRole
from schemas.routing import RoutedExperts
from workers.llm.contract import (
    CAPACITY_HEADER,
    LOAD_HEADER,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ReplicaStatus,
    UpdateWeightsRequest,
)
from workers.llm.engines.exceptions import EngineClosedError, InvalidRequestError
from workers.llm.engines.hf.status_routes import add_status_routes
from workers.metrics import ReplicaCounters, replica_families
from workers.weights.exceptions import WeightLoadError

if TYPE_CHECKING:
    from workers.llm.engines.hf.engine import GenerationResult, HFEngine, HFEngineConfig

__all__ = ["create_app", "serve"]

logger = logging.getLogger("rollout.llm.replica.hf")

BACKEND = "hf"
_ENGINE = web.AppKey("engine", object)
_STATE = web.AppKey("state", dict)


class _EngineCollector:
    """Prometheus collector that reads the engine's counters at scrape time."""

    def __init__(self, engine: HFEngine, replica_id: str, state: dict[str, Any]) -> None:
        self.engine, self.replica, self.state = engine, replica_id, state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        # `EngineStats` holds the engine's cumulative counters, under the contract's names.
        counters = ReplicaCounters(running=e.running, waiting=e.waiting, **asdict(e.stats))
        yield from replica_families(
            self.replica,
            counters,
            policy_version=e.version,
            load=float(_load(e)),  # what the balancers rank by, over `capacity`
            capacity=float(e.config.max_batch),
        )
        # How many completions this replica answered (`rollout bench routing` counts them).
        done = CounterMetricFamily(
            "rollout_replica_completions", "Completions answered.", labels=["replica"]
        )
        done.add_metric([self.replica], float(self.state.get("completions", 0)))
        yield done


def _error(status: int, message: str, kind: str, version: int) -> web.Response:
    body = {"error": {"message": message, "type": kind}, "policy_version": version}
    return web.json_response(body, status=status)


def _engine(request: web.Request) -> HFEngine:
    return request.app[_ENGINE]  # type: ignore[return-value]


def _ok(request: web.Request, body: dict[str, Any]) -> web.Response:
    return web.json_response({**body, "policy_version": _engine(request).version})


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Translate every failure into the contract's error body."""
    version = _engine(request).version
    try:
        return await handler(request)
    except (InvalidRequestError, WeightLoadError) as exc:
        kind = getattr(exc, "type", "invalid_request_error")
        return _error(400, str(exc), kind, version)
    except ValidationError as exc:
        return _error(400, exc.json(include_url=False), "invalid_request_error", version)
    except EngineClosedError as exc:
        return _error(503, str(exc), "service_unavailable", version)
    except web.HTTPException as exc:
        return _error(exc.status, exc.reason, "http_error", version)
    except Exception as exc:  # the server's own fault: report it, keep serving
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error(500, repr(exc), "internal_error", version)


async def _body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"body is not valid JSON: {exc}") from exc


async def _completions(request: web.Request) -> web.Response:
    engine, state = _engine(request), request.app[_STATE]
    req = CompletionRequest.model_validate(await _body(request))
    params = req.sampling()
    request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    await state["weights"].wait()  # started for broadcast weights: none served before them
    result = await engine.generate(
        req.prompt, params, request_id, req.return_routed_experts, images=req.images or ()
    )
    tokenizer = state["tokenizer"]
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True) if tokenizer else ""
    choice = CompletionChoice(
        text=text,
        token_ids=result.token_ids,
        logprobs={"token_logprobs": result.logprobs} if params.logprobs is not None else None,
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        routed_experts=_routing(engine, result) if req.return_routed_experts else None,
    )
    response = CompletionResponse.one(
        choice,
        id=request_id,
        created=int(time.time()),
        model=state["model_name"],
        usage={
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids),
            "cached_tokens": result.cached_tokens,
        },
        policy_version=result.policy_version,
    )
    state["completions"] = state.get("completions", 0) + 1
    return web.Response(body=response.model_dump_json(), content_type="application/json")


def _routing(engine: HFEngine, result: GenerationResult) -> RoutedExperts:
    """The result's routing (none yet for a request aborted before its prefill)."""
    tap = engine.router_tap
    assert tap is not None  # the engine refused the request otherwise
    rows = result.routed_experts
    if rows is None:
        rows = np.zeros((0, tap.layers, tap.top_k), dtype=np.uint8)
    return RoutedExperts.from_array(rows, tap.num_experts)


async def _abort(request: web.Request) -> web.Response:
    body = await _body(request)
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InvalidRequestError('expected {"request_ids": [str, ...]}')
    return _ok(request, {"aborted": await _engine(request).abort(ids)})


async def _pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "abort")
    if mode != "abort":
        raise InvalidRequestError(f"pause mode {mode!r} not supported; only 'abort'")
    await _engine(request).pause()
    return _ok(request, {"is_paused": True})


async def _resume(request: web.Request) -> web.Response:
    await _engine(request).resume()
    return _ok(request, {"is_paused": False})


async def _is_paused(request: web.Request) -> web.Response:
    # Exactly the contract's body: callers (and the cross-backend test) compare it whole.
    return web.json_response({"is_paused": _engine(request).is_paused})


async def _update_weights(request: web.Request) -> web.Response:
    req = UpdateWeightsRequest.model_validate(await _body(request))
    engine, state = _engine(request), request.app[_STATE]
    if state["role"] != "policy":
        raise web.HTTPConflict(reason=f"a {state['role']} replica takes no policy weights")
    if req.transfer is not None:  # the trainer's grant: receive over its group
        from workers.weights.load import receive_checked

        grant, pool = req.transfer, state.setdefault("receive_buffers", [])
        timings = await engine.load_weights(
            lambda live: receive_checked(grant, live, pool), req.version
        )
    else:
        timings = await engine.update_weights(req.path, req.version)
    if state.pop("awaiting", False):  # it holds the trainer's weights now: it may serve
        state["weights"].set()
    return _ok(request, {"status": "ok", "version": req.version, "timings": timings})


async def _health(request: web.Request) -> web.Response:
    engine = _engine(request)
    # What its weight-sync controller wants with: the dtype it serves, gloo only (CPU).
    weights = {"dtype": _dtype(engine), "transfer_backends": ["gloo"]}
    if request.app[_STATE].get("awaiting"):  # out of routing until the trainer's weights land
        body = {"status": "unavailable", "version": engine.version, "reason": "awaiting weights"}
        return web.json_response(body | {"awaiting_weights": True} | weights, status=503)
    body = {"status": "ok", "version": engine.version, "load": _load(engine)}
    role = request.app[_STATE]["role"]
    return _ok(request, body | {"capacity": engine.config.max_batch, "role": role} | weights)


def _dtype(engine: HFEngine) -> str:
    """The dtype of the engine's floating weights (float32 unless a lent trainer's differ)."""
    for parameter in engine.model.parameters():
        if parameter.is_floating_point():
            return str(parameter.dtype).removeprefix("torch.")
    return "float32"


def _load(engine: HFEngine) -> int:
    return int(engine.running + engine.waiting)


async def _report_load(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries the replica's load (`LOAD_HEADER`; an answered completion's
    sequence has left the engine by then, so it is not counted) and its batch limit
    (`CAPACITY_HEADER`: the sequences it runs at once; more wait)."""
    engine = _engine(request)
    response.headers[LOAD_HEADER] = str(_load(engine))
    response.headers[CAPACITY_HEADER] = str(engine.config.max_batch)


async def _info(request: web.Request) -> web.Response:
    engine, state = _engine(request), request.app[_STATE]
    status = ReplicaStatus(
        replica_id=state["replica_id"],
        backend=BACKEND,
        model=state["model_name"],
        version=engine.version,
        max_model_len=engine.max_model_len,
        is_paused=engine.is_paused,
        running=engine.running,
        waiting=engine.waiting,
    )
    return _ok(request, status.model_dump() | {"role": state["role"]})


async def _models(request: web.Request) -> web.Response:
    engine, name = _engine(request), request.app[_STATE]["model_name"]
    card = {
        "id": name,
        "object": "model",
        "owned_by": "rollout",
        "max_model_len": engine.max_model_len,
    }
    return _ok(request, {"object": "list", "data": [card]})


async def create_app(
    model_dir: str | Path,
    *,
    replica_id: str = "hf-0",
    version: int = 0,
    config: HFEngineConfig | None = None,
    served_model_name: str | None = None,
    await_weights: bool = False,
    role: ReplicaRole = "policy",
    model: Any = None,
) -> web.Application:
    """Load the model (in a worker thread) and build the app; the engine closes with the app.

    `await_weights` (the trainer broadcasts its weights): serve nothing until a weight load
    succeeds (completions wait for it, `/health` answers 503 `awaiting_weights`).
    `role="judge"`: another model than the policy, which takes no weight update (module
    docstring). `model`: serve this live model object instead of loading one (a lending
    trainer's policy: `HFEngine`'s `model`)."""
    import asyncio

    from workers.llm.engines.hf.engine import HFEngine

    engine = await asyncio.to_thread(HFEngine, model_dir, config, version, model=model)
    weights = asyncio.Event()  # completions wait here while the trainer's weights are awaited
    if not await_weights:
        weights.set()
    tokenizer = await asyncio.to_thread(_load_tokenizer, model_dir)
    registry = CollectorRegistry(auto_describe=False)
    app = web.Application(middlewares=[_errors])
    app[_ENGINE] = engine
    app[_STATE] = {
        "replica_id": replica_id,
        "model_name": served_model_name or str(model_dir),
        "tokenizer": tokenizer,
        "completions": 0,
        "awaiting": await_weights,
        "weights": weights,
        "role": role,
    }
    registry.register(_EngineCollector(engine, replica_id, app[_STATE]))  # type: ignore[arg-type]

    async def _close(_: web.Application) -> None:
        await engine.aclose()

    app.on_cleanup.append(_close)
    app.on_response_prepare.append(_report_load)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/abort_requests", _abort)
    app.router.add_post("/pause", _pause)
    app.router.add_post("/resume", _resume)
    app.router.add_get("/is_paused", _is_paused)
    app.router.add_post("/update_weights", _update_weights)
    app.router.add_get("/v1/models", _models)
    add_status_routes(app, health=_health, info=_info, registry=registry)
    logger.info("replica %s: model %s version %d ready", replica_id, model_dir, version)
    return app


def _load_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer for the `text` field, or None (token ids are what matter)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer in %s (%s); responses carry empty text", model_dir, exc)
        return None


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    replica_id: str | None = None,
    version: int = 0,
    *,
    threads: int = 2,
    max_batch: int = 64,
    prefix_cache_tokens: int = 32768,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    await_weights: bool = False,
    role: ReplicaRole = "policy",
    dtype: Literal["float32", "bfloat16"] = "float32",
) -> None:
    """Run the replica until interrupted (blocking)."""
    from workers.llm.engines.hf.engine import HFEngineConfig

    config = HFEngineConfig(
        threads=threads,
        max_batch=max_batch,
        prefix_cache_tokens=prefix_cache_tokens,
        max_model_len=max_model_len,
        dtype=dtype,
    )
    rid = replica_id or f"{BACKEND}-{port}"
    from workers.llm.engines.hf.classify import create_classifier_app, is_classifier

    if is_classifier(model_dir):  # a reward model: /classify instead of generation
        app = create_classifier_app(model_dir, replica_id=rid, version=version, threads=threads)
    else:
        app = create_app(
            model_dir,
            replica_id=rid,
            version=version,
            config=config,
            served_model_name=served_model_name,
            await_weights=await_weights,
            role=role,
        )
    logger.info("replica %s listening on http://%s:%d", rid, host, port)
    web.run_app(app, host=host, port=port, handler_cancellation=True, print=None, access_log=None)
