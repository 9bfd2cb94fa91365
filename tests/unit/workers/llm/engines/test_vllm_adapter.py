"""The vllm backend's contract adapter against a fake vLLM server (no GPU, no vllm package).

The fake answers the endpoints the adapter uses with vLLM's shapes (see test_vllm_mapping.py
for the sources): a "long" completion runs until it is aborted (then returns its partial
tokens with finish "abort", as vLLM v1 does) or its client disconnects; dev-mode endpoints can
be switched off to exercise the fallbacks an older vLLM needs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.workers.llm.engines.gate_rig import Rig, gate_rig
from workers.llm.engines.vllm.adapter import VLLMAdapter

LONG = 1000  # max_tokens at or above this: the fake generates until aborted
CONTEXT = 40  # longer prompts get vLLM's 400

VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0
"""


def vllm_response(token_ids: list[int], finish_reason: str) -> dict[str, Any]:
    """vLLM's /v1/completions body (serving.py) with return_token_ids and logprobs=0."""
    lps = [-0.5] * len(token_ids)
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "",
                "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in token_ids]},
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": token_ids,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(token_ids)},
    }


@dataclass
class FakeVLLM:
    has_abort: bool = True
    has_pause: bool = True
    has_extension: bool = True
    has_server_info: bool = True
    engines: int = 1  # data-parallel engines: each files its report; the answer has engine 0's
    files_reports: bool = True
    paused: asyncio.Event = field(default_factory=asyncio.Event)  # set = running
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    disconnected: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.paused.set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/abort_requests", self.abort)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_post("/reset_prefix_cache", self.record)
        app.router.add_post("/collective_rpc", self.rpc)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/server_info", self.server_info)
        return app

    async def server_info(self, request: web.Request) -> web.Response:
        if not self.has_server_info:
            return web.json_response({"detail": "Not Found"}, status=404)
        assert request.query.get("config_format") == "json"
        config = {
            "scheduler_config": {"max_num_seqs": 4},
            "parallel_config": {"data_parallel_size": 2},
        }
        return web.json_response({"vllm_config": config, "vllm_env": {}, "system_env": {}})

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/v1/completions", body))
        if len(body["prompt"]) > CONTEXT:
            err = {"message": "prompt too long", "type": "BadRequestError", "code": 400}
            return web.json_response({"error": err}, status=400)
        await self.paused.wait()  # vLLM's paused scheduler holds new requests
        if body["max_tokens"] < LONG:
            n = body["max_tokens"]
            return web.json_response(vllm_response(list(range(n)), "length"))
        engine_id = f"cmpl-{body['request_id']}-0"
        aborted = self.running[engine_id] = asyncio.Event()
        try:
            await asyncio.wait_for(aborted.wait(), timeout=10)
        except asyncio.CancelledError:
            self.disconnected.append(engine_id)
            raise
        finally:
            self.running.pop(engine_id, None)
        return web.json_response(vllm_response([7, 7, 7], "abort"))

    async def abort(self, request: web.Request) -> web.Response:
        if not self.has_abort:
            return web.json_response({"detail": "Not Found"}, status=404)
        ids = (await request.json())["request_ids"]
        self.calls.append(("/abort_requests", ids))
        for i in ids:
            if i in self.running:
                self.running[i].set()
        return web.json_response({"status": "aborted", "aborted": len(ids)})

    async def pause(self, request: web.Request) -> web.Response:
        if not self.has_pause:
            return web.json_response({"detail": "Not Found"}, status=404)
        self.calls.append(("/pause", request.query.get("mode")))
        self.paused.clear()
        for ev in self.running.values():
            ev.set()
        return web.json_response({"status": "paused"})

    async def resume(self, _request: web.Request) -> web.Response:
        if not self.has_pause:
            return web.json_response({"detail": "Not Found"}, status=404)
        self.calls.append(("/resume", None))
        self.paused.set()
        return web.json_response({"status": "resumed"})

    async def record(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, None))
        return web.Response()

    async def rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/collective_rpc", body))
        if not self.has_extension:  # vLLM started without --worker-extension-cls
            return web.json_response({"error": "AttributeError: no method"}, status=500)
        report = {"reprocessed": ["lm_head"], "parameters": 9}
        where = body["kwargs"].get("report_dir")
        for engine in range(self.engines):  # every engine runs it (WeightSync files it)
            if where and self.files_reports:
                (Path(where) / f"{engine}.json").write_text(json.dumps(report | {"rank": engine}))
        return web.json_response({"results": [report | {"rank": 0}]})  # engine 0's only

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({})

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]}
        )


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with gate_rig(
        FakeVLLM(),
        VLLMAdapter,
        replica_id="r0",
        served_model_name="tiny",
        initial_version=3,
        drain_timeout_s=2.0,
    ) as rig:
        yield rig


async def test_completion_round_trip_stamps_the_version(rig: Rig) -> None:
    status, body = await rig.complete(max_tokens=4, request_id="t0")
    assert status == 200
    assert body["policy_version"] == 3 and body["id"] == "t0"
    assert body["choices"][0]["token_ids"] == [0, 1, 2, 3]
    assert body["choices"][0]["logprobs"] == {"token_logprobs": [-0.5] * 4}
    sent = rig.fake.calls[0][1]
    assert sent["prompt"] == [1, 2, 3] and sent["model"] == "tiny" and sent["logprobs"] == 0
    assert sent["request_id"].startswith("t0-")
    assert rig.adapter.max_model_len == 2048


async def test_abort_returns_partial_tokens(rig: Rig) -> None:
    gen = asyncio.create_task(rig.complete(max_tokens=LONG, request_id="t1"))
    await rig.until(lambda: rig.fake.running)
    resp = await rig.client.post("/abort_requests", json={"request_ids": ["t1"]})
    assert (await resp.json())["aborted"] == 1
    status, body = await gen
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["token_ids"] == [7, 7, 7]
    (ids,) = [c[1] for c in rig.fake.calls if c[0] == "/abort_requests"]
    assert len(ids) == 1 and ids[0].startswith("cmpl-t1-") and ids[0].endswith("-0")


async def test_abort_of_unknown_id_aborts_nothing(rig: Rig) -> None:
    resp = await rig.client.post("/abort_requests", json={"request_ids": ["nope"]})
    assert (await resp.json())["aborted"] == 0
    assert not [c for c in rig.fake.calls if c[0] == "/abort_requests"]  # never an empty list


async def test_abort_without_vllm_endpoint_drops_the_connection(rig: Rig) -> None:
    rig.fake.has_abort = False
    gen = asyncio.create_task(rig.complete(max_tokens=LONG, request_id="t2"))
    await rig.until(lambda: rig.fake.running)
    await rig.client.post("/abort_requests", json={"request_ids": ["t2"]})
    status, body = await gen
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["token_ids"] == [] and body["policy_version"] == 3
    await rig.until(lambda: rig.fake.disconnected)


@pytest.mark.parametrize("vllm_pause", [True, False])
async def test_pause_aborts_in_flight_and_holds_new_requests(rig: Rig, vllm_pause: bool) -> None:
    rig.fake.has_pause = vllm_pause
    gen = asyncio.create_task(rig.complete(max_tokens=LONG, request_id="t3"))
    await rig.until(lambda: rig.fake.running)
    assert (await rig.client.post("/pause")).status == 200
    status, body = await gen
    assert body["choices"][0]["finish_reason"] == "abort"
    assert (await (await rig.client.get("/is_paused")).json()) == {"is_paused": True}
    held = asyncio.create_task(rig.complete(max_tokens=2))
    await asyncio.sleep(0.2)
    assert not held.done()
    assert (await rig.client.post("/resume")).status == 200
    status, body = await held
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert (await (await rig.client.get("/is_paused")).json()) == {"is_paused": False}


async def test_update_weights_aborts_old_version_then_serves_new(rig: Rig, tmp_path: Path) -> None:
    gen = asyncio.create_task(rig.complete(max_tokens=LONG, request_id="t4"))
    await rig.until(lambda: rig.fake.running)
    resp = await rig.client.post("/update_weights", json={"path": str(tmp_path), "version": 5})
    assert resp.status == 200 and (await resp.json())["version"] == 5
    status, body = await gen
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "abort" and body["policy_version"] == 3
    health = await (await rig.client.get("/health")).json()
    assert health == {
        "status": "ok",
        "version": 5,
        "load": 0,
        "capacity": 8,
        "transfer_backends": ["gloo", "nccl"],
    }
    _, body = await rig.complete(max_tokens=2)
    assert body["policy_version"] == 5
    rpcs = [c[1] for c in rig.fake.calls if c[0] == "/collective_rpc"]
    assert [(r["method"], r["kwargs"]["weights_path"]) for r in rpcs] == [
        ("rollout_load_weights", str(tmp_path))
    ]
    assert not Path(rpcs[0]["kwargs"]["report_dir"]).exists()  # the call's own, removed
    order = [c[0] for c in rig.fake.calls if c[0] != "/v1/completions"]
    assert order.index("/pause") < order.index("/collective_rpc")
    assert order.index("/reset_prefix_cache") < order.index("/resume")


async def test_update_weights_without_the_extension_fails_and_says_so(
    rig: Rig, tmp_path: Path
) -> None:
    """No silent fallback to a bare reload_weights (stale head on tied models)."""
    rig.fake.has_extension = False
    resp = await rig.client.post("/update_weights", json={"path": str(tmp_path), "version": 5})
    assert resp.status == 500 and "rollout_load_weights" in (await resp.json())["error"]["message"]
    health = await rig.client.get("/health")
    assert health.status == 503 and rig.adapter.version == 3
    assert not rig.adapter.paused  # resumed: it serves the old weights, marked unhealthy


async def test_update_weights_rejects_missing_checkpoint(rig: Rig, tmp_path: Path) -> None:
    resp = await rig.client.post(
        "/update_weights", json={"path": str(tmp_path / "x"), "version": 1}
    )
    assert resp.status == 400 and "not found" in (await resp.json())["error"]["message"]
    assert rig.adapter.version == 3 and not rig.adapter.paused


async def test_load_counts_requests_in_vllm_and_held_at_the_gate(rig: Rig) -> None:
    from workers.llm.contract import CAPACITY_HEADER, LOAD_HEADER

    async def health() -> tuple[int, int]:
        body = await (await rig.client.get("/health")).json()
        return body["load"], body["capacity"]

    gen = asyncio.create_task(rig.complete(max_tokens=LONG, request_id="t9"))
    await rig.until(lambda: rig.fake.running)
    resp = await rig.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    # the long one in vLLM; the one answered is not counted; 4 seqs x 2 data-parallel ranks
    assert (resp.headers[LOAD_HEADER], resp.headers[CAPACITY_HEADER]) == ("1", "8")
    assert await health() == (1, 8)
    assert (await rig.client.post("/pause")).status == 200
    await gen
    held = asyncio.create_task(rig.complete(max_tokens=2))
    await rig.until(lambda: rig.adapter._held == 1)
    assert await health() == (1, 8)  # waiting here, not in vLLM: still load
    text = await (await rig.client.get("/metrics")).text()
    assert 'rollout_replica_load{replica="r0"} 1.0' in text
    assert 'rollout_replica_capacity{replica="r0"} 8.0' in text
    assert (await rig.client.post("/resume")).status == 200
    assert (await held)[0] == 200
    assert await health() == (0, 8)


async def test_capacity_is_left_out_where_vllm_does_not_say(rig: Rig) -> None:
    from workers.llm.contract import CAPACITY_HEADER, LOAD_HEADER

    rig.fake.has_server_info = False
    assert await rig.adapter.wait_until_ready(lambda: True, 5.0)
    resp = await rig.client.get("/health")
    body = await resp.json()
    assert body == {"status": "ok", "version": 3, "load": 0, "transfer_backends": ["gloo", "nccl"]}
    assert resp.headers[LOAD_HEADER] == "0" and CAPACITY_HEADER not in resp.headers
    assert "rollout_replica_capacity" not in await (await rig.client.get("/metrics")).text()


async def test_metrics_and_info(rig: Rig) -> None:
    text = await (await rig.client.get("/metrics")).text()
    assert 'rollout_replica_prefix_cache_hits_total{replica="r0"} 512.0' in text
    assert 'rollout_replica_policy_version{replica="r0"} 3.0' in text
    info = await (await rig.client.get("/info")).json()
    assert info == {
        "replica_id": "r0",
        "backend": "vllm",
        "model": "tiny",
        "version": 3,
        "max_model_len": 2048,
        "is_paused": False,
        "running": 5,
        "waiting": 1,
    }


async def test_bad_requests_get_the_contract_error_shape(rig: Rig) -> None:
    resp = await rig.client.post("/v1/completions", json={"prompt": [], "max_tokens": 2})
    assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
    resp = await rig.client.post("/v1/completions", json={"prompt": [1], "bogus": 1})
    assert resp.status == 400
    rig.fake.calls.clear()
    status, body = await rig.complete(max_tokens=2, temperature=-1)
    assert status == 400 and not rig.fake.calls  # refused before reaching vLLM
    status, body = await rig.complete(prompt=[1] * (CONTEXT + 1), max_tokens=2)
    assert status == 400
    assert body == {"error": {"message": "prompt too long", "type": "BadRequestError"}}


async def test_health_is_503_until_vllm_is_ready(tmp_path: Path) -> None:
    adapter = VLLMAdapter(upstream_url="http://127.0.0.1:9", replica_id="r", served_model_name="m")
    async with TestClient(TestServer(adapter.app())) as client:
        resp = await client.get("/health")
        assert resp.status == 503 and (await resp.json())["reason"] == "starting"
        assert not await adapter.wait_until_ready(lambda: False, 1.0)


async def test_routed_experts_are_refused_where_vllm_does_not_return_them(rig: Rig) -> None:
    status, body = await rig.complete(max_tokens=2, return_routed_experts=True)
    assert status == 400 and "does not return routing" in body["error"]["message"]
    assert not [c for c in rig.fake.calls if c[0] == "/v1/completions"]  # never sent


class RoutingFake(FakeVLLM):
    """vLLM started with --enable-return-routed-experts: every response carries routing."""

    async def completions(self, request: web.Request) -> web.Response:
        import io

        import numpy as np
        import pybase64

        body = await request.json()
        self.calls.append(("/v1/completions", body))
        n = body["max_tokens"]
        out = vllm_response(list(range(n)), "length")
        rows = np.arange((len(body["prompt"]) + n - 1) * 8, dtype=np.uint8).reshape(-1, 4, 2) % 8
        with io.BytesIO() as buf:
            np.save(buf, rows, allow_pickle=False)
            out["choices"][0]["routed_experts"] = pybase64.b64encode(buf.getvalue()).decode()
        return web.json_response(out)


async def test_routed_experts_pass_through_when_vllm_returns_them() -> None:
    async with gate_rig(
        RoutingFake(), VLLMAdapter, replica_id="r0", served_model_name="tiny", num_experts=8
    ) as rig:
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "return_routed_experts": True}
        resp = await rig.client.post("/v1/completions", json=body)
        routed = (await resp.json())["choices"][0]["routed_experts"]
        assert resp.status == 200 and {k: routed[k] for k in ("layers", "top_k")} == {
            "layers": 4,
            "top_k": 2,
        }
        assert routed["num_experts"] == 8 and isinstance(routed["experts"], str)  # packed u1
        body["return_routed_experts"] = False
        resp = await rig.client.post("/v1/completions", json=body)
        assert (await resp.json())["choices"][0]["routed_experts"] is None


async def test_an_image_without_its_bytes_is_a_400_before_the_gate() -> None:
    adapter = VLLMAdapter(upstream_url="http://127.0.0.1:9", replica_id="r", served_model_name="m")
    ref = {"sha256": "ab" * 32, "mime_type": "image/png", "size": 3}
    async with TestClient(TestServer(adapter.app())) as client:
        resp = await client.post(
            "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "images": [ref]}
        )
        assert resp.status == 400
        assert "without their bytes inline" in (await resp.json())["error"]["message"]


async def test_image_placeholders_that_do_not_match_the_images_are_a_400() -> None:
    adapter = VLLMAdapter(
        upstream_url="http://127.0.0.1:9", replica_id="r", served_model_name="m",
        image_token_id=1024,
    )  # fmt: skip
    ref = {"sha256": "ab" * 32, "mime_type": "image/png", "size": 3, "data": "AAEC"}
    async with TestClient(TestServer(adapter.app())) as client:
        resp = await client.post(
            "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "images": [ref]}
        )
        assert resp.status == 400
        assert "1 image(s) but 0 image placeholder" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("files_reports", [True, False])
async def test_every_data_parallel_engines_report_is_read(files_reports: bool, tmp_path) -> None:
    """vLLM answers /collective_rpc with engine 0's results only; the workers file theirs, so
    a load counts once every engine reported, and one with a report missing fails."""

    fake = FakeVLLM(engines=2, files_reports=files_reports)
    async with gate_rig(
        fake, VLLMAdapter, replica_id="dp", served_model_name="tiny", initial_version=0, receivers=2
    ) as rig:
        body = {"path": str(tmp_path), "version": 1}
        resp = await rig.client.post("/update_weights", json=body)
        if files_reports:
            assert resp.status == 200, await resp.text()
            assert rig.adapter.version == 1
        else:
            assert resp.status == 500
            assert "1 of the replica's 2 vLLM workers" in (await resp.json())["error"]["message"]
            assert rig.adapter.version == 0
