"""JSON over HTTP as the tests speak to a replica or an adapter: (status, body) of a GET, or
of a POST of `body`; an error status with its body, (0, None) when nothing answers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http(url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, None
