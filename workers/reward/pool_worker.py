"""One scorer-pool process: reads JSON requests on stdin, writes JSON replies on stdout.

Started by `workers.reward.pool.ScorerPool` as `python -m workers.reward.pool_worker`.
Frames are a 4-byte big-endian length and an orjson body (no pickle):

    request  {"fn": "math" | "custom", "args": {...}}
    reply    {"ok": true, "result": ...} | {"ok": false, "error_class": str, "message": str}

The first frame written is `{"ok": true, "result": "ready"}`, after the heavy imports. The
protocol uses a private duplicate of fd 1; fd 1 itself is pointed at stderr, so a library
that prints cannot corrupt a frame. The process dies with its parent (PR_SET_PDEATHSIG on
Linux, and a watchdog on the parent pid), so a worker stuck in a pathological computation
never outlives the stage.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import orjson

__all__ = ["main", "read_frame", "write_frame"]

_LEN = struct.Struct(">I")


def read_frame(stream: IO[bytes]) -> Any | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (size,) = _LEN.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return orjson.loads(body)


def write_frame(stream: IO[bytes], data: Any) -> None:
    body = orjson.dumps(data)
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


def _die_with_parent() -> None:
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        except OSError:
            pass

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


_custom_cache: dict[tuple[str, str], Callable[..., Any]] = {}


def _custom(args: dict[str, Any]) -> Any:
    key = (args.pop("path"), args.pop("name"))
    fn = _custom_cache.get(key)
    if fn is None:
        fn = getattr(importlib.import_module(key[0]), key[1])
        _custom_cache[key] = fn
    kwargs = args.pop("kwargs", None) or {}
    result = fn(**args, **kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _math(args: dict[str, Any]) -> Any:
    from workers.reward.scorers.math import math_score

    return math_score(
        args["response"],
        args["ground_truth"],
        format_score=args.get("format_score", 0.0),
        score=args.get("score", 1.0),
    )


def _sleep(args: dict[str, Any]) -> Any:
    """A test hook: sleep, then echo (lets tests exercise timeouts without sympy)."""
    time.sleep(float(args.get("seconds", 0)))
    return args.get("echo")


FUNCTIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "math": _math,
    "custom": _custom,
    "sleep": _sleep,
}


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _die_with_parent()
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for module in os.environ.get("ROLLOUT_POOL_PRELOAD", "").split(","):
        if module:
            importlib.import_module(module)
    stdin = sys.stdin.buffer
    write_frame(out, {"ok": True, "result": "ready"})
    while True:
        request = read_frame(stdin)
        if request is None:
            return
        try:
            result = FUNCTIONS[request["fn"]](dict(request.get("args") or {}))
            reply = {"ok": True, "result": result}
        except Exception as exc:  # reported to the parent, which decides
            reply = {"ok": False, "error_class": type(exc).__name__, "message": str(exc)[:4000]}
        try:
            write_frame(out, reply)
        except TypeError as exc:  # a result orjson cannot encode
            write_frame(out, {"ok": False, "error_class": "TypeError", "message": str(exc)})


if __name__ == "__main__":
    main()
