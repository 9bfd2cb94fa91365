"""The `sglang` replica backend: launch SGLang's own server and serve the replica contract in
front of it.

Not in the registry's static list: `workers.llm.engines` offers it only where the `sglang`
package is found by the interpreter chosen for it (`config.check_sglang_python`).
Started by `rollout replica serve --backend sglang --model DIR --port P [--tp N --dp N --pp N]
[--sglang-python PY] [--sglang-arg ARG ...]`. Not proven against a running SGLang yet: it
cannot run on the development machines' CPUs (README "SGLang" has the failure), and
infra/gpu_check.sh (`BACKEND=sglang`) runs the contract tests against it on a GPU.

Process model (`workers.llm.engines.child_server`, as the vllm backend): this process runs
the aiohttp adapter (`SGLangAdapter`) on `--port` at once, then SGLang as a child in its own
process group on a loopback port; no SGLang server outlives its adapter. SGLang's output goes to
`$TMPDIR/rollout-sglang-<replica>.log` unless `log_file`; a start that fails raises
`ReplicaStartError` with the one line that says why (`start_failure`), not the traceback.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

from workers.llm.engines.child_output import root_cause
from workers.llm.engines.child_server import run_behind_adapter, served_by
from workers.llm.engines.exceptions import BackendUnavailableError
from workers.llm.engines.sglang.adapter import SGLangAdapter
from workers.llm.engines.sglang.config import (
    SGLangReplicaConfig,
    build_sglang_command,
    check_sglang_python,
)
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
_BARE_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception):\s*$")


def start_failure(lines: Iterable[str]) -> str | None:
    """The one line that says why SGLang did not start: the last exception line, as for vLLM
    (`child_output.root_cause`), or, where that line is bare because the message follows on its
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
    """The registry's gate (`workers.llm.engines.GATED_BACKENDS`): the interpreter that will
    run SGLang; BackendUnavailableError unless it finds the `sglang` package."""
    return check_sglang_python(python)


async def serve_async(config: SGLangReplicaConfig) -> int:
    """Run one replica until SIGTERM/SIGINT or until SGLang exits; returns the exit status."""
    python = check_sglang_python(config.python)
    if config.await_weights:
        raise BackendUnavailableError(
            "sglang",
            "it loads weights from disk only; weights.mode=broadcast needs hf or vllm",
        )
    if config.dtype_reason:
        print(f"rollout: SGLang serves in {config.dtype} ({config.dtype_reason})", file=sys.stderr)
    internal_port = config.internal_port or free_port(config.internal_host)
    adapter = SGLangAdapter(**config.adapter_settings(internal_port))
    return await run_behind_adapter(
        adapter,
        host=config.host,
        port=config.port,
        cmd=build_sglang_command(config, internal_port=internal_port, python=python),
        env=None,
        log_file=config.log_file,
        startup_timeout_s=config.startup_timeout_s,
        start_failure=start_failure,
    )


#: The registry's entry: `serve(model_dir, host, port, replica_id, version, **options)`.
serve = served_by(SGLangReplicaConfig, serve_async)
