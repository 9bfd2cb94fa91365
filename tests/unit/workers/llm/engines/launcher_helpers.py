"""What the launcher tests of both gate backends (`rollout replica serve --backend vllm|sglang`
in front of a stand-in engine) ask of the launched replica over HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any


def call(url: str, body: Any = None) -> tuple[int, Any]:
    """(status, JSON) of a GET, or of a POST of `body`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_healthy(url: str, timeout_s: float = 60) -> tuple[int, Any]:
    """The replica's `/health` once it is 200, or its last answer when `timeout_s` runs out."""
    deadline, status, body = time.monotonic() + timeout_s, 0, None
    while time.monotonic() < deadline:
        try:
            status, body = call(url + "/health")
        except OSError:
            status = 0
        if status == 200:
            break
        time.sleep(0.3)
    return status, body
