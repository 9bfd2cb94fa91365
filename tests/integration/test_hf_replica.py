"""The `hf` replica as a real subprocess serving the contract over HTTP, on the tiny model.

One server for the module (start-up is mostly importing torch); tests that change its state
(pause, weights) put it back. Logprobs are checked against an independent forward pass of the
same weights over prompt + response: for a request alone, for requests that joined a running
batch, and for one whose prompt was served from the prefix cache.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
aiohttp = pytest.importorskip("aiohttp")

from pipeline.harness.models.tiny import init_model  # noqa: E402
from pipeline.launch.replicas import wait_healthy  # noqa: E402
from tests.conftest import REPO, ROLLOUT  # noqa: E402
from workers.ports import free_port  # noqa: E402

pytestmark = pytest.mark.slow

START_VERSION = 3
MAX_BATCH = 3  # the replica's capacity: the tests run at most this many requests at once
PROMPT = [1, *range(40, 90), 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-replica")
    return {"a": init_model(root / "a", seed=0), "b": init_model(root / "b", seed=1)}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("hf-log") / "replica.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [*ROLLOUT, "replica", "serve", "--backend", "hf", "--model", str(models["a"])]
    cmd += ["--port", str(port), "--replica-id", "t0", "--version", str(START_VERSION)]
    cmd += ["--threads", "1", "--max-batch", str(MAX_BATCH)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None, 120, log=log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return {k: AutoModelForCausalLM.from_pretrained(p).eval() for k, p in models.items()}


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def call(http: Any, url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with http.request(method, url + path, json=body) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def complete(http: Any, url: str, **kw: Any) -> dict[str, Any]:
    status, body = await call(http, url, "POST", "/v1/completions", {"prompt": PROMPT} | kw)
    assert status == 200, body
    return body


async def wait_running(http: Any, url: str, n: int = 1) -> None:
    for _ in range(200):
        if (await call(http, url, "GET", "/info"))[1]["running"] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("request never started running")


def long_request(http: Any, url: str, request_id: str) -> asyncio.Task[dict[str, Any]]:
    kw = {"max_tokens": 1900, "ignore_eos": True, "temperature": 1.0, "request_id": request_id}
    return asyncio.ensure_future(complete(http, url, **kw))


def reference_logprobs(model: Any, prompt: list[int], out: list[int], temperature: float) -> Any:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0].float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(scaled, dim=-1)[len(prompt) - 1 : len(prompt) + len(out) - 1]
    return lp.gather(1, torch.tensor(out)[:, None]).squeeze(1)


def assert_logprobs_match(model: Any, prompt: list[int], body: dict[str, Any], temp: float) -> None:
    choice = body["choices"][0]
    got = torch.tensor(choice["logprobs"]["token_logprobs"])
    want = reference_logprobs(model, prompt, choice["token_ids"], temp)
    assert got.shape == want.shape and got.numel() > 0
    assert (got - want).abs().mean().item() < 1e-4


async def test_completion_returns_tokens_logprobs_and_version(server: str, http: Any) -> None:
    version = (await call(http, server, "GET", "/health"))[1]["version"]
    assert version >= START_VERSION
    body = await complete(http, server, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    (choice,) = body["choices"]
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == 8 and all(lp <= 0.0 for lp in lps)
    assert body["policy_version"] == version
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    again = await complete(http, server, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    assert again["choices"][0]["token_ids"] == choice["token_ids"]  # per-request seed

    first = choice["token_ids"]
    stop = await complete(
        http, server, max_tokens=8, temperature=1.0, seed=11, stop_token_ids=[first[2]]
    )
    assert stop["choices"][0]["finish_reason"] == "stop"
    assert stop["choices"][0]["stop_reason"] == first[2]
    assert stop["choices"][0]["token_ids"] == first[: first.index(first[2]) + 1]

    _, info = await call(http, server, "GET", "/info")
    assert info["replica_id"] == "t0" and info["backend"] == "hf"
    assert info["max_model_len"] == 2048 and info["policy_version"] == version
    _, models = await call(http, server, "GET", "/v1/models")
    assert models["data"][0]["max_model_len"] == 2048


async def test_bad_requests_get_4xx_and_the_server_keeps_serving(server: str, http: Any) -> None:
    async with http.post(server + "/v1/completions", data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    bad = [
        {"prompt": PROMPT, "max_tokens": 4, "best_of": 2},  # unknown parameter
        {"prompt": PROMPT, "max_tokens": 2048},  # past the context
        {"prompt": [], "max_tokens": 4},
        {"prompt": [5, 10**6], "max_tokens": 4},  # not a token id of this model
        {"prompt": PROMPT, "temperature": -1},
    ]
    for body in bad:
        status, err = await call(http, server, "POST", "/v1/completions", body)
        assert 400 <= status < 500, (body, err)
        assert set(err["error"]) == {"message", "type"}, err
    status, err = await call(
        http, server, "POST", "/update_weights", {"path": "/nonexistent", "version": 99}
    )
    assert status == 400 and "error" in err
    assert (await call(http, server, "GET", "/nowhere"))[0] == 404
    assert (await call(http, server, "POST", "/abort_requests", {"ids": "x"}))[0] == 400
    assert (await call(http, server, "GET", "/health"))[1]["version"] != 99
    body = await complete(http, server, max_tokens=3, ignore_eos=True)
    assert len(body["choices"][0]["token_ids"]) == 3


async def test_every_response_reports_load_and_capacity(server: str, http: Any) -> None:
    """What the balancers rank by: running + waiting, not counting the answered request, and
    the batch limit, on every response, in /health and at /metrics."""
    from workers.llm.contract import CAPACITY_HEADER, LOAD_HEADER

    async def reported() -> tuple[int, int, dict[str, float]]:
        health = (await call(http, server, "GET", "/health"))[1]
        text = (await call(http, server, "GET", "/metrics"))[1]
        metrics = {
            line.split("{")[0]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(("rollout_replica_load", "rollout_replica_capacity"))
        }
        return health["load"], health["capacity"], metrics

    assert (await reported())[:2] == (0, MAX_BATCH)
    ids = [f"load-{i}" for i in range(MAX_BATCH + 1)]
    tasks = [long_request(http, server, ids[0]), long_request(http, server, ids[1])]
    try:
        await wait_running(http, server, 2)
        body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
        async with http.post(server + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            # the two long ones; the short one has left the batch when its answer is written
            assert resp.headers[LOAD_HEADER] == "2"
            assert resp.headers[CAPACITY_HEADER] == str(MAX_BATCH)
        tasks += [long_request(http, server, i) for i in ids[2:]]
        await wait_running(http, server, MAX_BATCH)
        for _ in range(100):  # the last one waits: the batch is full
            if (await call(http, server, "GET", "/info"))[1]["waiting"] == 1:
                break
            await asyncio.sleep(0.02)
        load, capacity, metrics = await reported()
        assert (load, capacity) == (MAX_BATCH + 1, MAX_BATCH)
        assert metrics == {
            "rollout_replica_load": MAX_BATCH + 1,
            "rollout_replica_capacity": MAX_BATCH,
        }
    finally:
        await call(http, server, "POST", "/abort_requests", {"request_ids": ids})
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert (await reported())[0] == 0


async def test_the_client_hands_load_and_capacity_to_its_balancer(server: str, http: Any) -> None:
    from workers.llm.client import LLMClient, LLMClientConfig

    config = LLMClientConfig(routing="load", health_interval_s=3600.0)
    async with LLMClient(config, [server]) as client:
        rep = client.balancer.get(server)
        assert rep is not None
        long = long_request(http, server, "bystander")  # another client's request
        try:
            await wait_running(http, server)
            rep.load, rep.capacity = -1, 0  # forget what a /health probe may have said
            await client.generate("mine", PROMPT, {"max_tokens": 2, "ignore_eos": True})
            # read off this response's headers: the bystander, and the batch limit
            assert (rep.load, rep.capacity, rep.since) == (1, MAX_BATCH, 0)
            assert client.balancer.fills() == [1 / MAX_BATCH]
        finally:
            await call(http, server, "POST", "/abort_requests", {"request_ids": ["bystander"]})
            await asyncio.wait_for(long, 30)


async def test_abort_returns_partial_tokens(server: str, http: Any) -> None:
    task = long_request(http, server, "abort-1")
    await wait_running(http, server)
    await asyncio.sleep(0.2)
    status, body = await call(http, server, "POST", "/abort_requests", {"request_ids": ["abort-1"]})
    assert status == 200 and body["aborted"] == ["abort-1"]
    choice = (await asyncio.wait_for(task, 30))["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < 1900
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])


async def test_client_disconnect_aborts_its_request(server: str, http: Any) -> None:
    task = long_request(http, server, "gone-1")
    await wait_running(http, server)
    task.cancel()
    for _ in range(100):
        if (await call(http, server, "GET", "/info"))[1]["running"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("a disconnected client's request kept running")


async def test_pause_mid_generation_then_resume(server: str, http: Any) -> None:
    task = long_request(http, server, "pause-1")
    await wait_running(http, server)
    try:
        assert (await call(http, server, "POST", "/pause"))[0] == 200
        interrupted = await asyncio.wait_for(task, 30)
        assert interrupted["choices"][0]["finish_reason"] == "abort"
        assert len(interrupted["choices"][0]["token_ids"]) > 0
        assert (await call(http, server, "GET", "/is_paused"))[1] == {"is_paused": True}
        held = asyncio.ensure_future(complete(http, server, max_tokens=4, ignore_eos=True))
        await asyncio.sleep(0.5)
        assert not held.done(), "a request ran while the replica was paused"
        assert (await call(http, server, "GET", "/info"))[1]["waiting"] == 1
    finally:
        assert (await call(http, server, "POST", "/resume"))[0] == 200
    assert (await asyncio.wait_for(held, 30))["choices"][0]["finish_reason"] == "length"
    assert (await call(http, server, "GET", "/is_paused"))[1] == {"is_paused": False}


async def test_update_weights_mid_generation(
    server: str, http: Any, models: dict[str, Path], reference: dict[str, Any]
) -> None:
    before = (await call(http, server, "GET", "/health"))[1]["version"]
    task = long_request(http, server, "update-1")
    await wait_running(http, server)
    try:
        body = {"path": str(models["b"]), "version": before + 1}
        status, resp = await call(http, server, "POST", "/update_weights", body)
        assert status == 200 and resp["version"] == before + 1, resp
        interrupted = await asyncio.wait_for(task, 30)
        assert interrupted["choices"][0]["finish_reason"] == "abort"
        assert interrupted["policy_version"] == before  # the weights that made those tokens
        after = await complete(http, server, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert after["policy_version"] == before + 1
        assert_logprobs_match(reference["b"], PROMPT, after, 0.0)  # really serving b now
    finally:
        body = {"path": str(models["a"]), "version": before + 2}
        assert (await call(http, server, "POST", "/update_weights", body))[0] == 200
    assert (await call(http, server, "GET", "/health"))[1]["version"] == before + 2


async def test_logprobs_match_a_separate_forward_pass(
    server: str, http: Any, reference: dict[str, Any]
) -> None:
    model = reference["a"]
    first = long_request(http, server, "lp-long")
    await wait_running(http, server)
    # These join the running batch (left-padded, different lengths and temperatures).
    p2, p3 = [1, *range(300, 340)], [1, *range(500, 507)]
    second, third = await asyncio.gather(
        complete(http, server, prompt=p2, max_tokens=40, temperature=0.7, ignore_eos=True),
        complete(http, server, prompt=p3, max_tokens=30, temperature=0.0, ignore_eos=True),
    )
    assert not first.done(), "the long request should still be running"
    assert_logprobs_match(model, p2, second, 0.7)
    assert_logprobs_match(model, p3, third, 0.0)
    await call(http, server, "POST", "/abort_requests", {"request_ids": ["lp-long"]})
    assert_logprobs_match(model, PROMPT, await asyncio.wait_for(first, 30), 1.0)

    # The next turn of the conversation: its prompt extends `second`'s prompt + response.
    p4 = p2 + second["choices"][0]["token_ids"] + [1, 600, 601, 2]
    fourth = await complete(http, server, prompt=p4, max_tokens=20, temperature=0.9)
    assert fourth["usage"]["cached_tokens"] >= len(p2) + 40 - 1
    assert_logprobs_match(model, p4, fourth, 0.9)

    status, text = await call(http, server, "GET", "/metrics")
    assert status == 200
    metrics = {line.split("{")[0]: line for line in text.splitlines() if not line.startswith("#")}
    for name in (
        "rollout_replica_running_requests",
        "rollout_replica_waiting_requests",
        "rollout_replica_generated_tokens_total",
        "rollout_replica_prefix_cache_queries_total",
        "rollout_replica_prefix_cache_hits_total",
        "rollout_replica_policy_version",
        "rollout_replica_in_flight",
        "rollout_replica_prefix_cache_hit_rate",
    ):
        assert name in metrics and 'replica="t0"' in metrics[name], name
    assert 0 < float(metrics["rollout_replica_prefix_cache_hit_rate"].split()[-1]) <= 1
    assert float(metrics["rollout_replica_prefix_cache_hits_total"].split()[-1]) >= len(p2) + 39
