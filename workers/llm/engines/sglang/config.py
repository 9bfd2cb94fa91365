"""Configuration of an `sglang` replica and the SGLang server command line it launches.

Pure: builds argument lists and environments, starts nothing and never imports `sglang`.

The child is `PYTHON -m sglang.launch_server --model-path MODEL ...` (SGLang's own server; the
module, so no PATH lookup) on an internal loopback port. PYTHON is the interpreter of the
environment SGLang is installed in (`resolve_sglang_python`: the configured one, else
`.venv-sglang/bin/python` of this checkout when it exists — `make sglang` builds it — else this
interpreter). `check_sglang_python` is the gate of the replica registry: a backend whose
interpreter cannot find the `sglang` package is not offered (`workers.llm.engines`).

The child gets what the contract needs:
- `--enable-metrics`, so `/metrics` has the running/queued gauges and the token counters;
- `--served-model-name`, `--random-seed`, `--dtype` (the trainer's precision, as for vLLM);
- `--tp-size / --dp-size / --pp-size` (world size = TP x DP x PP GPUs behind one address);
- `--weight-version V`: SGLang's own label of the weights it serves, kept equal to the
  adapter's policy version (each `/update_weights_from_disk` sets it too);
- `--skip-tokenizer-init` when the model directory has no tokenizer (token ids in and out);
- `--disable-cuda-graph` with `enforce_eager` (a faster start, as vLLM's `--enforce-eager`).
Flags the adapter depends on may not be overridden through the extra arguments; anything else
is passed through verbatim (e.g. `--attention-backend`, `--mem-fraction-static`).

Not proven: SGLang has never run under this launcher (it cannot run on the development
machines' CPUs; README "SGLang"); infra/gpu_check.sh runs it on a GPU where SGLang installs.
"""

from __future__ import annotations

from typing import ClassVar

from workers.llm.engines.served_config import (
    REPO_ROOT,
    ServedReplicaConfig,
    ServerFlags,
    check_python,
    resolve_python,
    server_command,
)

__all__ = [
    "MANAGED_FLAGS",
    "SGLangReplicaConfig",
    "build_sglang_command",
    "check_sglang_python",
    "resolve_sglang_python",
]

MANAGED_FLAGS: frozenset[str] = frozenset(
    {
        "--host",
        "--port",
        "--model-path",
        "--model",
        "--served-model-name",
        "--tp-size",
        "--tensor-parallel-size",
        "--dp-size",
        "--data-parallel-size",
        "--pp-size",
        "--pipeline-parallel-size",
        "--weight-version",
        "--enable-metrics",
    }
)
DEFAULT_SGLANG_VENV = REPO_ROOT / ".venv-sglang"


class SGLangReplicaConfig(ServedReplicaConfig):
    """One SGLang replica: the adapter's address and the SGLang server behind it (the sglang
    backend loads weights from disk only and refuses to start with `await_weights`)."""

    managed_flags: ClassVar[frozenset[str]] = MANAGED_FLAGS


def resolve_sglang_python(configured: str | None = None) -> str:
    """The interpreter to run SGLang with: `configured`, else .venv-sglang's, else this one."""
    return resolve_python(configured, DEFAULT_SGLANG_VENV)


def check_sglang_python(configured: str | None = None) -> str:
    """The resolved interpreter; BackendUnavailableError unless it runs and finds `sglang`
    (`find_spec` only: SGLang's import takes seconds and pulls in torch)."""
    python = resolve_sglang_python(configured)
    hint = (
        "build .venv-sglang with `make sglang` where SGLang runs, or name one with "
        "--sglang-python; README: SGLang"
    )
    check_python(python, "sglang", "sglang", hint)
    return python


SGLANG_FLAGS = ServerFlags(
    launch=("-m", "sglang.launch_server"),
    model="--model-path",
    tp="--tp-size",
    dp="--dp-size",
    pp="--pp-size",
    seed="--random-seed",
    context="--context-length",
    memory="--mem-fraction-static",
    eager="--disable-cuda-graph",
)


def build_sglang_command(
    config: SGLangReplicaConfig, *, internal_port: int, python: str | None = None
) -> list[str]:
    """The argv of the SGLang server child (`python` overrides `config.python`)."""
    return server_command(
        config,
        SGLANG_FLAGS,
        python=python or resolve_sglang_python(config.python),
        internal_port=internal_port,
        own=["--weight-version", str(config.initial_version), "--enable-metrics"],
    )
