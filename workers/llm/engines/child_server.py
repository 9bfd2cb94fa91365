"""Run an inference server as a child process behind its contract adapter (vLLM, SGLang).

Process model: this process runs the adapter's aiohttp app on `host:port` at once, so health
checks see 503 "starting" instead of a refused connection, then starts the server as a child
in its own process group on a loopback port and waits for it to become healthy. It stops on
SIGTERM/SIGINT (terminating that group: SIGTERM, then SIGKILL after 30 s) or when the server
exits (with the server's status). Killed outright (SIGKILL), it cannot stop the server itself,
so on Linux the child asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG): no
server outlives its adapter.

The server's output goes to a log file (named on stderr at start), and to stderr too under
`rollout -v`; a server that fails to start raises `ReplicaStartError` with the one line that
says why (the backend's `start_failure`), not its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from workers.llm.engines.child_output import relay
from workers.llm.engines.exceptions import ReplicaStartError
from workers.llm.engines.gate import GatedAdapter

__all__ = ["KILL_GRACE_S", "default_log", "run_behind_adapter", "served_by"]

#: How long a stopping adapter gives its server after SIGTERM; a launcher that stops the
#: adapter waits longer than this before its own SIGKILL (`pipeline.launch.local.STOP_GRACE_S`).
KILL_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TAIL_LINES = 400  # of the server's output, searched for the root cause of a failed start


def default_log(backend: str, replica_id: str) -> str:
    """`$TMPDIR/rollout-<backend>-<replica id>.log`, the id made safe for a file name."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in replica_id)
    return os.path.join(tempfile.gettempdir(), f"rollout-{backend}-{safe}.log")


def _dies_with(parent: int) -> Any:
    """A preexec_fn: in the child, SIGTERM when `parent` dies (Linux; elsewhere a no-op)."""

    def arm() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the request was armed
            os._exit(1)

    return arm


async def _terminate(proc: asyncio.subprocess.Process, engine: str, log: logging.Logger) -> None:
    """Stop the child and the processes it spawned (its own process group)."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), timeout=wait_s)
        except TimeoutError:
            log.warning("%s (pid %d) did not exit after %s", engine, proc.pid, sig.name)


async def run_behind_adapter(
    adapter: GatedAdapter,
    *,
    host: str,
    port: int,
    cmd: Sequence[str],
    env: Mapping[str, str] | None,
    log_file: str | None,
    startup_timeout_s: float,
    start_failure: Callable[[Iterable[str]], str | None],
) -> int:
    """Serve `adapter` on `host:port`, run `cmd` (the server) until SIGTERM/SIGINT or until it
    exits; the exit status (0 when stopped by a signal)."""
    engine, log = adapter.engine, adapter.log
    # handler_cancellation: a caller that hangs up cancels its request upstream too.
    runner = web.AppRunner(adapter.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log_path = Path(log_file or default_log(adapter.backend, adapter.replica_id))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"rollout: {engine}'s output goes to {log_path}", file=sys.stderr)
    log.info("replica %s: adapter on %s:%d, starting %s: %s", adapter.replica_id, host, port,
             engine, " ".join(cmd))  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        env=None if env is None else dict(env),
        start_new_session=True,
        preexec_fn=_dies_with(os.getpid()),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    output = log_path.open("ab")
    echo = sys.stderr.buffer if log.isEnabledFor(logging.INFO) else None  # rollout -v
    assert proc.stdout is not None
    relaying = asyncio.create_task(relay(proc.stdout, output, tail, echo))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.create_task(
        adapter.wait_until_ready(lambda: proc.returncode is None, startup_timeout_s)
    )
    stopped = asyncio.create_task(stop.wait())
    exited = asyncio.create_task(proc.wait())
    try:
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            return 0
        if not ready.result():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(relaying), 5.0)  # the last lines
            why = start_failure(tail) or f"exit status {proc.returncode}"
            raise ReplicaStartError(f"{engine} did not start: {why} (its whole output: {log_path})")
        log.info("replica %s ready: model=%s max_model_len=%d version=%d", adapter.replica_id,
                 adapter.served_model_name, adapter.max_model_len, adapter.version)  # fmt: skip
        await asyncio.wait([stopped, exited], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            return 0
        log.error("%s exited with status %s", engine, proc.returncode)
        return proc.returncode or 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for task in (ready, stopped, exited):
            task.cancel()
        await _terminate(proc, engine, log)
        relaying.cancel()
        output.close()
        await runner.cleanup()


def served_by(
    config_class: Callable[..., Any], run: Callable[[Any], Awaitable[int]]
) -> Callable[..., int]:
    """The registry's `serve(model_dir, host, port, replica_id, version, **options)` of an
    engine whose server runs behind an adapter: its replica config (`config_class`, with
    `options` as further fields: `tp`, `max_model_len`, `extra_args`, ...), then `run(config)`
    until SIGTERM/SIGINT or until the server exits (blocking); the exit status."""

    def serve(
        model_dir: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        replica_id: str | None = None,
        version: int = 0,
        **options: Any,
    ) -> int:
        config = config_class(
            model=str(model_dir),
            host=host,
            port=port,
            replica_id=replica_id,
            initial_version=version,
            **options,
        )
        return asyncio.run(run(config))

    serve.__doc__ = served_by.__doc__
    return serve
