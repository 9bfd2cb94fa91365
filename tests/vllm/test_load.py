"""A real vLLM replica reports its load and capacity as the hf replica does.

The session's untied replica (tests/vllm/conftest.py), started with `--max-num-seqs 2`
(`UNTIED_MAX_NUM_SEQS`), so the capacity it reports is one the suite chose (not vLLM's platform
default) and a third long request has to wait inside vLLM; sharing it saves a vLLM start, and
whatever version the weight-sync tests left it at does not matter here. The load the adapter
counts is checked against vLLM's own running + waiting gauges (`/info`).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.vllm.support import CONTEXT, UNTIED_MAX_NUM_SEQS, Replica, http
from workers.llm.contract import CAPACITY_HEADER, LOAD_HEADER

pytestmark = pytest.mark.vllm

SEQS = UNTIED_MAX_NUM_SEQS
PROMPT = [1, *range(40, 60), 2]


def _completion(url: str, **body: Any) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"prompt": PROMPT} | body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def _until(what: str, cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(0.05)


def test_load_and_capacity_on_every_response_in_health_and_metrics(
    untied_replica: Replica,
) -> None:
    url = untied_replica.url

    def health() -> dict[str, Any]:
        return dict(http(url + "/health")[1])

    def gauges() -> tuple[int, int]:  # vLLM's own, as /info relays them
        info = http(url + "/info")[1]
        return info["running"], info["waiting"]

    assert (health()["load"], health()["capacity"]) == (0, SEQS)
    # 8000 tokens each: two at a time take ~50 s here, far longer than the checks below
    budget = CONTEXT - len(PROMPT) - 8
    ids = [f"load-{i}" for i in range(SEQS + 1)]
    with ThreadPoolExecutor(len(ids)) as pool:
        kw = {"max_tokens": budget, "ignore_eos": True}
        running = [pool.submit(_completion, url, request_id=rid, **kw) for rid in ids]
        try:
            # the adapter counts a request the moment it passes: no lag to wait out
            _until("the adapter counts all three", lambda: health()["load"] == SEQS + 1, 10.0)
            metrics = {
                line.split("{")[0]: float(line.split()[-1])
                for line in http(url + "/metrics")[1].splitlines()
                if line.startswith(("rollout_replica_load", "rollout_replica_capacity"))
            }
            assert metrics == {"rollout_replica_load": SEQS + 1, "rollout_replica_capacity": SEQS}
            # vLLM's gauges follow one stats interval later, and say the same: 2 run, 1 waits
            _until("vLLM runs two and queues one", lambda: gauges() == (SEQS, 1))
            assert health()["load"] == SEQS + 1 and not any(f.done() for f in running)
            assert http(url + "/abort_requests", {"request_ids": ids[:2]})[0] == 200
            _until("two aborted", lambda: sum(f.done() for f in running) == 2)
            _, headers = _completion(url, max_tokens=2, ignore_eos=True)
            # the one left; the short one is answered, so it is not counted
            assert (headers[LOAD_HEADER], headers[CAPACITY_HEADER]) == ("1", str(SEQS))
        finally:
            assert http(url + "/abort_requests", {"request_ids": ids})[0] == 200
            done = [fut.result(timeout=120) for fut in running]
    assert all(body["choices"][0]["finish_reason"] == "abort" for body, _ in done)
    assert health()["load"] == 0
