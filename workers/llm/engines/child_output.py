"""A child server's own output (vLLM's, SGLang's), kept in a log file, and the one line that
says why it failed to start.

A vLLM that fails to start prints a long traceback, often more than one (the engine core's,
then the API server's "Engine core initialization failed. See root cause above"), and the
cause is a single line in the middle: `ValueError: ... KV cache ...`. `relay` copies the
child's output, line by line, to a log file (and to stderr when asked: `rollout -v`) and keeps
its tail; `root_cause` picks that line out of the tail, so the replica fails with one line
naming the cause and the file with everything. A pydantic `ValidationError` (vLLM checks its
config with pydantic) names the cause on a later line (`  Value error, Model Runner V2 requires
Triton. [type=value_error, …]`): that message is added to the line. Pure but for the file and
stream it is given.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Iterable
from typing import BinaryIO

__all__ = ["relay", "root_cause"]

_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit))(?::\s*(.*))?$")
_WRAPPERS = ("root cause above", "engine core initialization failed")
#: vLLM's log prefix: "(EngineCore_DP0 pid=7) ERROR 12-02 04:17:27 [core.py:700] "
_PREFIX = re.compile(
    r"""^(?:\([^)]*\)\s*)?                      # (EngineCore_DP0 pid=7)
        (?:(?:ERROR|WARNING|INFO|DEBUG)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?  # level date time [at]
    """,
    re.VERBOSE,
)


#: the message of one pydantic error: "  Value error, <message> [type=value_error, ..."
_PYDANTIC_DETAIL = re.compile(r"^(?:Value error, )?(.+?)\s+\[type=")


def root_cause(lines: Iterable[str]) -> str | None:
    """The last exception line that is not a wrapper pointing elsewhere ("See root cause
    above"), without vLLM's log prefix; None when there is no exception line at all."""
    found: list[str] = []
    stripped = [_PREFIX.sub("", raw.strip()) for raw in lines]
    for i, line in enumerate(stripped):
        match = _EXCEPTION.match(line)
        if match and match.group(2):
            if match.group(1) == "ValidationError":
                details = (_PYDANTIC_DETAIL.match(d) for d in stripped[i + 1 : i + 4])
                line += "".join(f": {d.group(1)}" for d in details if d)
            found.append(line)
    real = [line for line in found if not any(w in line.lower() for w in _WRAPPERS)]
    return (real or found or [None])[-1]


async def relay(
    stream: asyncio.StreamReader, log: BinaryIO, tail: deque[str], echo: BinaryIO | None
) -> None:
    """Copy `stream` to `log` (and `echo`) until it ends, keeping its last lines in `tail`."""
    while line := await stream.readline():
        log.write(line)
        log.flush()
        if echo is not None:
            echo.write(line)
            echo.flush()
        tail.append(line.decode("utf-8", "replace"))
