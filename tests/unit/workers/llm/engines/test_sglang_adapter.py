"""The sglang backend's contract adapter against a fake SGLang server (no sglang package).

The fake answers the endpoints the adapter uses with SGLang 0.5.23's shapes (see
test_sglang_mapping.py for the sources): a "long" generation runs until `/abort_request` names
its rid or `/pause_generation` aborts everything (then it returns its partial tokens with
finish "abort", as SGLang does), and paused, it holds new requests until
`/continue_generation`. This checks the adapter's own logic (versions, gate, drain, load); that
SGLang behaves as the fake does is what infra/gpu_check.sh (`BACKEND=sglang`) checks on a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.unit.workers.llm.engines.gate_rig import Rig, gate_rig
from workers.llm.contract import CAPACITY_HEADER, LOAD_HEADER
from workers.llm.engines.sglang.adapter import SGLangAdapter

LONG = 1000  # max_new_tokens at or above this: the fake generates until aborted
CONTEXT = 40  # longer prompts get SGLang's 400

METRICS = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="tiny"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="tiny"} 1.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="tiny",is_streaming="false"} 30.0
"""


def generated(ids: list[int], finish: dict[str, Any]) -> dict[str, Any]:
    meta = {
        "id": "x",
        "finish_reason": finish,
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
    }
    return {"text": "", "output_ids": ids, "meta_info": meta}


@dataclass
class FakeSGLang:
    load_fails: bool = False
    paused: bool = False
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        app.router.add_post("/update_weights_from_disk", self.update)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/server_info", self.server_info)
        return app

    async def health(self, _r: web.Request) -> web.Response:
        return web.Response()

    async def metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "max_model_len": 64}]})

    async def server_info(self, _r: web.Request) -> web.Response:
        states = [{"effective_max_running_requests_per_dp": 4}] * 2
        return web.json_response({"internal_states": states, "version": "0.5.23"})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/generate", body))
        if len(body["input_ids"]) > CONTEXT:
            return web.json_response({"error": {"message": "longer than context"}}, status=400)
        while self.paused:  # SGLang's paused tokenizer manager holds new requests
            await self.resumed.wait()
        n = body["sampling_params"]["max_new_tokens"]
        if n < LONG:
            return web.json_response(generated(list(range(n)), {"type": "length", "length": n}))
        aborted = self.running[body["rid"]] = asyncio.Event()
        try:
            await asyncio.wait_for(aborted.wait(), timeout=10)
        finally:
            self.running.pop(body["rid"], None)
        return web.json_response(generated([7, 7, 7], {"type": "abort", "status_code": None}))

    async def abort(self, request: web.Request) -> web.Response:
        rid = (await request.json())["rid"]
        self.calls.append(("/abort_request", rid))
        for running, ev in self.running.items():
            if running.startswith(rid):
                ev.set()
        return web.Response()

    async def pause(self, request: web.Request) -> web.Response:
        self.calls.append(("/pause_generation", await request.json()))
        self.paused = True
        self.resumed.clear()
        for ev in self.running.values():
            ev.set()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, _r: web.Request) -> web.Response:
        self.calls.append(("/continue_generation", None))
        self.paused = False
        self.resumed.set()
        return web.json_response({"message": "Generation continued successfully."})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/update_weights_from_disk", body))
        if self.load_fails:
            answer = {"success": False, "message": "Failed to get weights iterator"}
            return web.json_response(answer | {"num_paused_requests": 0}, status=400)
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with gate_rig(
        FakeSGLang(),
        SGLangAdapter,
        replica_id="s0",
        served_model_name="tiny",
        initial_version=3,
        drain_timeout_s=2.0,
    ) as rig:
        yield rig


async def test_round_trip_stamps_the_version_and_reports_load_and_capacity(rig: Rig) -> None:
    resp = await rig.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
    body = await resp.json()
    assert resp.status == 200 and body["policy_version"] == 3
    assert body["choices"][0]["token_ids"] == [0, 1, 2, 3]
    assert body["choices"][0]["logprobs"] == {"token_logprobs": [-0.5] * 4}
    assert resp.headers[LOAD_HEADER] == "0" and resp.headers[CAPACITY_HEADER] == "8"
    assert rig.adapter.max_model_len == 64


async def test_abort_returns_partial_tokens(rig: Rig) -> None:
    running = asyncio.create_task(rig.complete(max_tokens=LONG, request_id="a-1"))
    await rig.until(lambda: rig.fake.running)
    resp = await rig.client.post("/abort_requests", json={"request_ids": ["a-1"]})
    assert (await resp.json())["aborted"] == 1
    status, body = await running
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["token_ids"] == [7, 7, 7] and body["id"] == "a-1"


async def test_pause_aborts_in_flight_and_holds_new_requests(rig: Rig) -> None:
    running = asyncio.create_task(rig.complete(max_tokens=LONG))
    await rig.until(lambda: rig.fake.running)
    assert (await rig.client.post("/pause")).status == 200
    assert (await running)[1]["choices"][0]["finish_reason"] == "abort"
    assert ("/pause_generation", {"mode": "abort"}) in rig.fake.calls
    held = asyncio.create_task(rig.complete(max_tokens=2))
    await rig.until(lambda: rig.adapter.load == 1)
    await asyncio.sleep(0.2)
    assert not held.done()
    assert (await rig.client.post("/resume")).status == 200
    assert (await held)[1]["choices"][0]["finish_reason"] == "length"
    assert (await (await rig.client.get("/is_paused")).json()) == {"is_paused": False}


async def test_update_weights_aborts_old_version_then_serves_new(rig: Rig, tmp_path: Path) -> None:
    running = asyncio.create_task(rig.complete(max_tokens=LONG))
    await rig.until(lambda: rig.fake.running)
    resp = await rig.client.post("/update_weights", json={"path": str(tmp_path), "version": 4})
    assert resp.status == 200 and (await resp.json())["version"] == 4
    old = (await running)[1]
    assert old["policy_version"] == 3 and old["choices"][0]["finish_reason"] == "abort"
    body = {"model_path": str(tmp_path), "weight_version": "4", "flush_cache": True}
    assert ("/update_weights_from_disk", body) in rig.fake.calls
    assert (await rig.complete(max_tokens=2))[1]["policy_version"] == 4
    assert not rig.adapter.paused


async def test_failed_load_is_a_500_and_unhealthy_until_a_load_succeeds(
    rig: Rig, tmp_path: Path
) -> None:
    rig.fake.load_fails = True
    resp = await rig.client.post("/update_weights", json={"path": str(tmp_path), "version": 4})
    assert resp.status == 500 and "weights iterator" in (await resp.json())["error"]["message"]
    health = await rig.client.get("/health")
    assert health.status == 503 and (await health.json())["version"] == 3
    rig.fake.load_fails = False
    resp = await rig.client.post("/update_weights", json={"path": str(tmp_path), "version": 4})
    assert resp.status == 200 and (await rig.client.get("/health")).status == 200


async def test_requests_it_cannot_serve_are_400s(rig: Rig, tmp_path: Path) -> None:
    status, body = await rig.complete(prompt=list(range(CONTEXT + 1)))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = await rig.complete(return_routed_experts=True)
    assert status == 400 and "routing" in body["error"]["message"]
    for bad in ({"path": str(tmp_path / "missing"), "version": 1}, {"path": "", "version": 1}):
        assert (await rig.client.post("/update_weights", json=bad)).status == 400
    assert (await rig.client.get("/health")).status == 200


async def test_metrics_and_info(rig: Rig) -> None:
    text = await (await rig.client.get("/metrics")).text()
    assert 'rollout_replica_running_requests{replica="s0"} 5.0' in text
    assert 'rollout_replica_policy_version{replica="s0"} 3.0' in text
    info = await (await rig.client.get("/info")).json()
    assert info["backend"] == "sglang" and (info["running"], info["waiting"]) == (5, 1)
