"""The `sglang` replica backend: launch SGLang's own server and serve the replica contract in
front of it.

Not in the registry's static list: `workers.llm.replicas` offers it only where the `sglang`
package is found by the interpreter chosen for it (`sglang_config.check_sglang_python`).
Started by `rollout replica serve --backend sglang --model DIR --port P [--tp N --dp N --pp N]
[--sglang-python PY] [--sglang-arg ARG ...]`. Not proven against a running SGLang yet: it
cannot run on the development machines' CPUs (README "SGLang" has the failure), and
infra/gpu_check.sh (`BACKEND=sglang`) runs the contract tests against it on a GPU.

Process model (the vllm backend's): this process runs the aiohttp adapter (`SGLangAdapter`) on
`--port` at once, so health checks see 503 "starting" instead of a refused connection, then
starts SGLang as a child in its own process group on a loopback port and waits for it to
become healthy. It stops on SIGTERM/SIGINT (terminating that group: SIGTERM, then SIGKILL after
30 s) or when SGLang exits (with SGLang's status). Killed outright, it cannot stop SGLang
itself, so on Linux the child asks for SIGTERM when its parent dies (PR_SET_PDEATHSIG).
SGLang's output goes to a log file (`$TMPDIR/rollout-sglang-<replica>.log` unless
`log_file`); a start that fails raises `ReplicaStartError` with the one line that says why
(`start_failure`), not the traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from workers.llm.replicas.exceptions import BackendUnavailableError, ReplicaStartError
from workers.llm.replicas.sglang_adapter import SGLangAdapter
from workers.llm.replicas.sglang_config import (
    SGLangReplicaConfig,
    build_sglang_command,
    check_sglang_python,
)
from workers.llm.replicas.vllm_output import relay, root_cause
from workers.ports import free_port

__all__ = [
    "BACKEND",
    "SGLangAdapter",
    "SGLangReplicaConfig",
    "check_engine",
    "serve",
    "serve_async",
    "start_failure",
]

BACKEND = "sglang"
logger = logging.getLogger("rollout.replica.sglang")
_KILL_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TAIL_LINES = 400
_BARE_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception):\s*$")


def start_failure(lines: Iterable[str]) -> str | None:
    """The one line that says why SGLang did not start: the last exception line, as for vLLM
    (`vllm_output.root_cause`), or, where that line is bare because the message follows on its
    own lines (sgl_kernel's ImportError), the exception joined with its first message line."""
    kept = [line.rstrip() for line in lines]
    found = root_cause(kept)
    if found is not None:
        return found
    for i in range(len(kept) - 1, -1, -1):
        if _BARE_EXCEPTION.match(kept[i].strip()):
            message = next((m.strip() for m in kept[i + 1 :] if m.strip()), "")
            return f"{kept[i].strip()} {message}".strip()
    return None


def check_engine(python: str | None = None) -> str:
    """The registry's gate (`workers.llm.replicas.GATED_BACKENDS`): the interpreter that will
    run SGLang; BackendUnavailableError unless it finds the `sglang` package."""
    return check_sglang_python(python)


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    replica_id: str | None = None,
    version: int = 0,
    **options: Any,
) -> int:
    """Run one replica until SIGTERM/SIGINT or until SGLang exits (blocking); the exit status.

    The registry's common signature; `options` are further `SGLangReplicaConfig` fields.
    """
    config = SGLangReplicaConfig(
        model=str(model_dir),
        host=host,
        port=port,
        replica_id=replica_id,
        initial_version=version,
        **options,
    )
    return asyncio.run(serve_async(config))


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


async def _terminate(proc: asyncio.subprocess.Process) -> None:
    """Stop the SGLang child and the processes it spawned (its own process group)."""
    for sig, wait_s in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), timeout=wait_s)
        except TimeoutError:
            logger.warning("SGLang (pid %d) did not exit after %s", proc.pid, sig.name)


async def serve_async(config: SGLangReplicaConfig) -> int:
    """Run one replica until SIGTERM/SIGINT or until SGLang exits; returns the exit status."""
    python = check_sglang_python(config.python)
    if config.await_weights:
        raise BackendUnavailableError(
            "sglang",
            "it loads weights from disk only; trainer.weight_transfer=broadcast needs hf or vllm",
        )
    if config.dtype_reason:
        print(f"rollout: SGLang serves in {config.dtype} ({config.dtype_reason})", file=sys.stderr)
    internal_port = config.internal_port or free_port(config.internal_host)
    adapter = SGLangAdapter(
        upstream_url=f"http://{config.internal_host}:{internal_port}",
        replica_id=config.resolved_replica_id(),
        served_model_name=config.resolved_served_name(),
        initial_version=config.initial_version,
        drain_timeout_s=config.drain_timeout_s,
    )
    runner = web.AppRunner(adapter.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    cmd = build_sglang_command(config, internal_port=internal_port, python=python)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in adapter.replica_id)
    log_path = Path(
        config.log_file or os.path.join(tempfile.gettempdir(), f"rollout-sglang-{safe}.log")
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"rollout: SGLang's output goes to {log_path}", file=sys.stderr)
    logger.info(
        "replica %s: starting SGLang on port %d: %s", adapter.replica_id, internal_port, cmd
    )
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        start_new_session=True,
        preexec_fn=_dies_with(os.getpid()),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    log_file = log_path.open("ab")
    echo = sys.stderr.buffer if logger.isEnabledFor(logging.INFO) else None  # rollout -v
    assert proc.stdout is not None
    relaying = asyncio.create_task(relay(proc.stdout, log_file, tail, echo))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.create_task(
        adapter.wait_until_ready(lambda: proc.returncode is None, config.startup_timeout_s)
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
            raise ReplicaStartError(f"SGLang did not start: {why} (its whole output: {log_path})")
        logger.info("replica %s ready: version=%d", adapter.replica_id, adapter.version)
        await asyncio.wait([stopped, exited], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            return 0
        logger.error("SGLang exited with status %s", proc.returncode)
        return proc.returncode or 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for task in (ready, stopped, exited):
            task.cancel()
        await _terminate(proc)
        relaying.cancel()
        log_file.close()
        await runner.cleanup()
