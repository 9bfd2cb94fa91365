"""The `vllm` replica backend: launch `vllm serve` and serve the replica contract in front of it.

Started by `rollout replica serve --backend vllm --model DIR --port P [--tp N --dp N --pp N]
[--vllm-python PY] [--vllm-arg ARG ...]`, the one command line (`pipeline.cli.stages`); this
module has none of its own. The adapter runs in that process, under `rollout`'s interpreter;
only the vLLM child runs in vLLM's environment.

Process model: this process runs the aiohttp adapter (`VLLMAdapter`) on `--port` at once, so
health checks see 503 "starting" instead of a refused connection, then starts vLLM as a child in
its own process group on a loopback port and waits for it to become healthy. It stops when it
gets SIGTERM/SIGINT (it then terminates that group: SIGTERM, then SIGKILL after 30 s) or when
vLLM exits (it exits with vLLM's status). Killed outright (SIGKILL), it cannot stop vLLM
itself, so on Linux the child asks the kernel for SIGTERM when its parent dies
(PR_SET_PDEATHSIG): no vLLM server outlives its adapter. Importing this module never imports
`vllm`: only the child does, in the interpreter `--vllm-python` names (see
`resolve_vllm_python`); one that does not exist or has no `vllm` raises
`BackendUnavailableError` before anything starts.

vLLM's output goes to a log file (`log_file`, default `$TMPDIR/rollout-vllm-<replica>.log`,
named at start), and to stderr too under `rollout -v`; a vLLM that fails to start raises
`ReplicaStartError` with the one line that says why (`vllm_output.root_cause`), not its
traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from aiohttp import web

from workers.llm.moe import experts_per_layer
from workers.llm.replicas.exceptions import BackendUnavailableError, ReplicaStartError
from workers.llm.replicas.vllm_adapter import VLLMAdapter
from workers.llm.replicas.vllm_config import (
    VLLMReplicaConfig,
    build_vllm_command,
    build_vllm_env,
    resolve_vllm_python,
)
from workers.llm.replicas.vllm_output import relay, root_cause
from workers.ports import free_port

__all__ = [
    "BACKEND",
    "VLLMAdapter",
    "VLLMReplicaConfig",
    "serve",
    "serve_async",
]

BACKEND = "vllm"
logger = logging.getLogger("rollout.replica.vllm")
_KILL_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TAIL_LINES = 400  # of vLLM's output, searched for the root cause of a failed start


async def _terminate(proc: asyncio.subprocess.Process) -> None:
    """Stop the vLLM child and the processes it spawned (its own process group)."""
    if proc.returncode is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), timeout=wait_s)
            return
        except TimeoutError:
            logger.warning("vLLM (pid %d) did not exit after %s", proc.pid, sig.name)


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    replica_id: str | None = None,
    version: int = 0,
    **options: Any,
) -> int:
    """Run one replica until SIGTERM/SIGINT or until vLLM exits (blocking); the exit status.

    The registry's common signature; `options` are further `VLLMReplicaConfig` fields
    (`tp`, `dp`, `pp`, `max_model_len`, `gpu_memory_utilization`, `extra_args`, ...).
    """
    config = VLLMReplicaConfig(
        model=str(model_dir),
        host=host,
        port=port,
        replica_id=replica_id,
        initial_version=version,
        **options,
    )
    return asyncio.run(serve_async(config))


def _default_log(replica_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in replica_id)
    return os.path.join(tempfile.gettempdir(), f"rollout-vllm-{safe}.log")


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


def check_vllm_python(python: str) -> None:
    """Raise BackendUnavailableError unless `python` runs and can import `vllm`."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailableError("vllm", f"cannot run {python}: {exc}") from exc
    if done.returncode != 0:
        raise BackendUnavailableError(
            "vllm", f"{python} has no vllm module (build one with `make vllm`, or --vllm-python)"
        )


async def serve_async(config: VLLMReplicaConfig) -> int:
    """Run one replica until SIGTERM/SIGINT or until vLLM exits; returns the exit status."""
    python = resolve_vllm_python(config.python)
    check_vllm_python(python)
    if config.dtype_reason:
        print(f"rollout: vLLM serves in {config.dtype} ({config.dtype_reason})", file=sys.stderr)
    num_experts = experts_per_layer(config.model) if config.return_routed_experts else None
    if config.return_routed_experts and num_experts is None:
        raise ReplicaStartError(
            f"--routed-experts: {config.model} is no Mixture-of-Experts model (its config.json "
            "names no experts), so it routes nothing"
        )
    internal_port = config.internal_port or free_port(config.internal_host)
    adapter = VLLMAdapter(
        upstream_url=f"http://{config.internal_host}:{internal_port}",
        replica_id=config.resolved_replica_id(),
        served_model_name=config.resolved_served_name(),
        initial_version=config.initial_version,
        drain_timeout_s=config.drain_timeout_s,
        num_experts=num_experts,
        await_weights=config.await_weights,
        receivers=config.world_size,
    )
    # handler_cancellation: a caller that hangs up cancels its request in vLLM too.
    runner = web.AppRunner(adapter.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    cmd = build_vllm_command(config, internal_port=internal_port, python=python)
    log_path = Path(config.log_file or _default_log(adapter.replica_id))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"rollout: vLLM's output goes to {log_path}", file=sys.stderr)
    logger.info(
        "replica %s: adapter on %s:%d, starting vLLM (world size %d) on port %d: %s",
        adapter.replica_id,
        config.host,
        config.port,
        config.world_size,
        internal_port,
        " ".join(cmd),
    )
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        env=build_vllm_env(routed_experts=config.return_routed_experts),
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
            why = root_cause(tail) or f"exit status {proc.returncode}"
            raise ReplicaStartError(f"vLLM did not start: {why} (its whole output: {log_path})")
        logger.info(
            "replica %s ready: model=%s max_model_len=%d version=%d",
            adapter.replica_id,
            adapter.served_model_name,
            adapter.max_model_len,
            adapter.version,
        )
        await asyncio.wait([stopped, exited], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            return 0
        logger.error("vLLM exited with status %s", proc.returncode)
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
