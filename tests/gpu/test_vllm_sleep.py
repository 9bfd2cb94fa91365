"""vLLM's sleep mode on a GPU: what hybrid lending (`trainer.lend`) would need of a vLLM engine
that shares the trainer's GPU (infra/gpu_check.sh, step 4c).

A vLLM server started with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1` (its `/sleep`,
`/wake_up`, `/is_sleeping` routes are development routes) serves a fixed greedy prompt; then:

- `POST /sleep?level=1` frees the GPU: the weights go to host memory, the KV cache is dropped
  (the process's GPU memory, read from `nvidia-smi`, falls by most of what it held), and
  `/is_sleeping` says so;
- `POST /wake_up` brings it back (`/is_sleeping` false), and the same prompt gives the same
  greedy tokens as before the sleep (level 1 keeps the weights);
- `POST /sleep?level=2` drops the weights too (what a lent engine whose weights come back
  from the trainer would do), and `/wake_up?tags=weights` then `?tags=kv_cache` wakes it in
  two steps (still asleep after the first), the route the trainer would take with a weight
  load between them.

vLLM's answers as they are: `/sleep` and `/wake_up` answer 200 with an empty body (no status
field); the state is read from `GET /is_sleeping` (`{"is_sleeping": bool}`). vLLM 0.32's CPU
build refuses `--enable-sleep-mode` ("Sleep mode is not supported on current platform": sleep
mode needs the CUDA memory pool), so this runs only on a GPU machine.

Environment: ROLLOUT_VLLM_SLEEP_URL (the vLLM server; the GPU holds no other process's memory,
so `nvidia-smi`'s per-process figures are its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

PROMPT = [(7 * i + 3) % 500 + 10 for i in range(32)]


@pytest.fixture
def url() -> str:
    value = os.environ.get("ROLLOUT_VLLM_SLEEP_URL")
    if not value:
        pytest.skip("ROLLOUT_VLLM_SLEEP_URL not set (infra/gpu_check.sh sets it)")
    return value.rstrip("/")


def call(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """GET (`/is_sleeping`, `/v1/models`) or POST; the JSON answer, or None for an empty body
    (what `/sleep` and `/wake_up` answer). Any status but 200 raises (urllib)."""
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if path in ("/is_sleeping", "/v1/models") else "POST"
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200, (path, resp.status)
        raw = resp.read()
    return json.loads(raw) if raw.strip() else None


def sleeping(url: str) -> bool:
    return bool(call(url, "/is_sleeping")["is_sleeping"])


def greedy(url: str) -> list[str]:
    model = call(url, "/v1/models")["data"][0]["id"]
    out = call(url, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 1,
    })  # fmt: skip
    return list(out["choices"][0]["logprobs"]["tokens"])


def gpu_mib() -> int:
    """GPU memory used by vLLM's processes (its engine core is a child of the server)."""
    rows = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    return sum(int(row.split(",")[1]) for row in rows if row.strip())


def test_sleep_frees_the_gpu_and_wake_up_serves_the_same_tokens(url: str) -> None:
    before = greedy(url)
    held = gpu_mib()
    assert sleeping(url) is False

    assert call(url, "/sleep?level=1") is None  # 200, empty body
    assert sleeping(url) is True
    asleep = gpu_mib()
    print(f"GPU memory: {held} MiB awake, {asleep} MiB asleep (level 1)")
    assert asleep < held * 0.5, (held, asleep)

    assert call(url, "/wake_up") is None
    assert sleeping(url) is False
    assert greedy(url) == before  # level 1 kept the weights in host memory


def test_level_2_drops_the_weights_and_wakes_in_two_steps(url: str) -> None:
    assert call(url, "/sleep?level=2") is None
    assert sleeping(url) is True
    # The lent engine's route: weights first (a weight load would go here), then the cache.
    assert call(url, "/wake_up?tags=weights") is None
    assert sleeping(url) is True  # the KV cache still sleeps
    assert call(url, "/wake_up?tags=kv_cache") is None
    assert sleeping(url) is False
    assert len(greedy(url)) == 16  # serves again (its weights: whatever was loaded)
