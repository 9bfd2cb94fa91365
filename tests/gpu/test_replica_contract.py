"""The replica contract, checked against a live replica of any backend.

Run by infra/gpu_check.sh (marker `gpu`, a replica it started), and on CPU by `make test-vllm`
(tests/vllm/test_contract.py collects these same tests, marker `vllm`, against a real vLLM
replica it starts). The replica's URL comes from the `replica_url` fixture: here the
environment's, overridden by tests/vllm/conftest.py.

Environment:
    ROLLOUT_REPLICA_URL           the replica, e.g. http://127.0.0.1:8100 (tests skip without it)
    ROLLOUT_UPDATE_WEIGHTS_PATH   a checkpoint for /update_weights; one whose weights differ
                                  from the served model's makes the test also check that greedy
                                  outputs change (default: reload the served model's own path)
    ROLLOUT_MODEL_PATH            the served model's directory (default for the above)

Standard library only (urllib + threads), so the GPU machine needs no extra client packages.
Long generations use `ignore_eos` and most of the context so that they are still running when
the test aborts or pauses them.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

URL = ""  # set by the `_replica` fixture
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(48)]  # 3 full 16-token KV blocks
# vLLM caches full KV blocks only, and block sizes differ: 16 on GPUs, 128 by default on CPUs
# (vllm/platforms/cpu.py), where a 48-token prompt fills none and never hits. 272 tokens fill
# 17 blocks of 16 and 2 of 128.
LONG_PROMPT = [(11 * i + 5) % 500 + 10 for i in range(272)]


def call(method: str, path: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        URL + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def complete(**kw: Any) -> dict[str, Any]:
    status, body = call("POST", "/v1/completions", {"prompt": PROMPT} | kw, timeout=300)
    assert status == 200, body
    return body


def version() -> int:
    status, body = call("GET", "/health")
    assert status == 200, body
    return int(body["version"])


def long_budget() -> int:
    _, info = call("GET", "/info")
    return max(64, int(info.get("max_model_len") or 2048) - len(PROMPT) - 8)


def start_long(pool: ThreadPoolExecutor, request_id: str) -> Future[dict[str, Any]]:
    fut = pool.submit(
        complete, max_tokens=long_budget(), ignore_eos=True, temperature=1.0, request_id=request_id
    )
    time.sleep(0.5)  # let it reach the engine and generate a little
    assert not fut.done(), "the long generation finished before it could be interrupted"
    return fut


@pytest.fixture(scope="module")
def replica_url() -> str:
    return os.environ.get("ROLLOUT_REPLICA_URL", "").rstrip("/")


@pytest.fixture(scope="module", autouse=True)
def _replica(replica_url: str) -> None:
    global URL
    URL = replica_url
    if not URL:
        pytest.skip("ROLLOUT_REPLICA_URL is not set")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if call("GET", "/health", timeout=5)[0] == 200:
                call("POST", "/resume")
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"replica at {URL} is not healthy")


def test_completion_returns_tokens_logprobs_and_version() -> None:
    body = complete(max_tokens=16, temperature=0.0, ignore_eos=True, request_id="c-1")
    (choice,) = body["choices"]
    assert len(choice["token_ids"]) == 16
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == 16 and all(lp <= 0.0 for lp in lps)
    assert choice["finish_reason"] == "length"
    assert body["policy_version"] == version()


def test_stop_token_finishes_with_stop() -> None:
    first = complete(max_tokens=8, temperature=0.0, ignore_eos=True)["choices"][0]["token_ids"]
    body = complete(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[first[2]])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"][-1] == first[2] and len(choice["token_ids"]) <= 3


def test_prompt_past_context_is_a_4xx() -> None:
    status, body = call("POST", "/v1/completions", {"prompt": [5] * 100_000, "max_tokens": 4})
    assert 400 <= status < 500 and "error" in body
    assert call("GET", "/health")[0] == 200


def test_abort_returns_partial_generation() -> None:
    with ThreadPoolExecutor(2) as pool:
        fut = start_long(pool, "abort-1")
        status, _ = call("POST", "/abort_requests", {"request_ids": ["abort-1"]})
        assert status == 200
        body = fut.result(timeout=60)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert len(choice["token_ids"]) < long_budget()
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])


def test_pause_aborts_in_flight_and_resume_serves_held_requests() -> None:
    with ThreadPoolExecutor(4) as pool:
        try:
            running = [start_long(pool, f"pause-{i}") for i in range(2)]
            assert call("POST", "/pause")[0] == 200
            for fut in running:
                body = fut.result(timeout=60)
                assert body["choices"][0]["finish_reason"] == "abort", str(body)[:300]
            assert call("GET", "/is_paused")[1] == {"is_paused": True}
            held = pool.submit(complete, max_tokens=4, temperature=0.0, ignore_eos=True)
            time.sleep(1.0)
            assert not held.done(), "a request ran while the replica was paused"
            status, body = call("POST", "/resume")
            assert status == 200, body
            assert held.result(timeout=60)["choices"][0]["finish_reason"] == "length"
        finally:  # a failure here must not leave the next tests a paused replica
            call("POST", "/resume")
    assert call("GET", "/is_paused")[1] == {"is_paused": False}


def test_update_weights_changes_the_version() -> None:
    path = os.environ.get("ROLLOUT_UPDATE_WEIGHTS_PATH") or os.environ.get("ROLLOUT_MODEL_PATH")
    if not path:
        pytest.skip("set ROLLOUT_UPDATE_WEIGHTS_PATH or ROLLOUT_MODEL_PATH")
    before_v = version()
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    before = complete(**greedy)["choices"][0]
    with ThreadPoolExecutor(2) as pool:
        fut = start_long(pool, "update-1")
        status, body = call("POST", "/update_weights", {"path": path, "version": before_v + 1}, 600)
        assert status == 200, body
        interrupted = fut.result(timeout=60)
    # The request in flight was aborted and keeps the version that produced its tokens.
    assert interrupted["choices"][0]["finish_reason"] == "abort"
    assert interrupted["policy_version"] == before_v
    assert version() == before_v + 1
    after = complete(**greedy)
    assert after["policy_version"] == before_v + 1
    if os.environ.get("ROLLOUT_UPDATE_WEIGHTS_PATH"):
        assert after["choices"][0]["logprobs"] != before["logprobs"], "weights did not change"


def _contract_metrics() -> dict[str, tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = call("GET", "/metrics")
    assert status == 200, text
    return {
        s.name: (s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("rollout_replica_")
    }


def test_metrics_expose_prefix_cache_counters() -> None:
    for _ in range(3):  # the same prompt: its full blocks are hits after the first time
        complete(prompt=LONG_PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True)
    deadline = time.monotonic() + 10
    while True:
        m = _contract_metrics()
        hits = m.get("rollout_replica_prefix_cache_hits_total", ({}, 0.0))[1]
        if hits > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name in (
        "rollout_replica_running_requests",
        "rollout_replica_waiting_requests",
        "rollout_replica_generated_tokens_total",
        "rollout_replica_prefix_cache_queries_total",
        "rollout_replica_prefix_cache_hits_total",
        "rollout_replica_policy_version",
    ):
        assert name in m, f"{name} missing from /metrics"
        assert "replica" in m[name][0]
    assert m["rollout_replica_prefix_cache_queries_total"][1] > 0
    assert hits > 0
    assert m["rollout_replica_generated_tokens_total"][1] > 0
    assert m["rollout_replica_policy_version"][1] == version()
