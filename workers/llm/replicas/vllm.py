"""The `vllm` replica backend: launch `vllm serve` and serve the replica contract in front of it.

    python -m workers.llm.replicas.vllm --model DIR --port P [--tp N --dp N --pp N] \\
        [--vllm-python PY] [--max-model-len L --gpu-memory-utilization F ...] [-- vllm args]

Arguments this parser does not know (or everything after a literal `--`) go to `vllm serve`.

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from workers.llm.replicas.exceptions import BackendUnavailableError
from workers.llm.replicas.vllm_adapter import VLLMAdapter
from workers.llm.replicas.vllm_config import (
    VLLMReplicaConfig,
    build_vllm_command,
    build_vllm_env,
    free_port,
    resolve_vllm_python,
    split_argv,
)

__all__ = [
    "BACKEND",
    "VLLMAdapter",
    "VLLMReplicaConfig",
    "build_arg_parser",
    "main",
    "serve",
    "serve_async",
]

BACKEND = "vllm"
logger = logging.getLogger("rollout.replica.vllm")
_KILL_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The options not named like the `VLLMReplicaConfig` field they set (every other one is).
_CONFIG_FIELD = {
    "vllm_python": "python",
    "version": "initial_version",
    "startup_timeout": "startup_timeout_s",
    "drain_timeout": "drain_timeout_s",
}


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workers.llm.replicas.vllm",
        description="Serve the replica contract backed by a vLLM server.",
        epilog="Unknown arguments, and all after '--', are passed to `vllm serve`.",
    )
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--port", type=int, required=True, help="port of the contract adapter")
    p.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to serve other machines")
    p.add_argument("--replica-id", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-logprobs", type=int, default=1)
    p.add_argument("--internal-port", type=int, default=None, help="vLLM's own port")
    p.add_argument(
        "--vllm-python", default=None, help="interpreter with vLLM (default: .venv-vllm's)"
    )
    p.add_argument(
        "--version", "--initial-version", type=int, default=0, help="policy version of --model"
    )
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(argv: Sequence[str]) -> tuple[VLLMReplicaConfig, str]:
    """Parse our options; what is left over becomes `extra_args` for `vllm serve`."""
    ours, after = split_argv(argv)
    ns, unknown = build_arg_parser().parse_known_args(ours)
    options = {_CONFIG_FIELD.get(name, name): value for name, value in vars(ns).items()}
    log_level = options.pop("log_level")
    # By field name: the config forbids extra fields, so an option without one fails here.
    config = VLLMReplicaConfig(**options, extra_args=(*unknown, *after))
    return config, log_level


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
    internal_port = config.internal_port or free_port(config.internal_host)
    adapter = VLLMAdapter(
        upstream_url=f"http://{config.internal_host}:{internal_port}",
        replica_id=config.resolved_replica_id(),
        served_model_name=config.resolved_served_name(),
        initial_version=config.initial_version,
        drain_timeout_s=config.drain_timeout_s,
    )
    # handler_cancellation: a caller that hangs up cancels its request in vLLM too.
    runner = web.AppRunner(adapter.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    cmd = build_vllm_command(config, internal_port=internal_port, python=python)
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
        *cmd, env=build_vllm_env(), start_new_session=True, preexec_fn=_dies_with(os.getpid())
    )
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
            logger.error("vLLM did not become healthy (exit status %s)", proc.returncode)
            return 1
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
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    config, log_level = config_from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve_async(config))


if __name__ == "__main__":
    sys.exit(main())
