"""Configuration of an `sglang` replica and the SGLang server command line it launches.

Pure: builds argument lists and environments, starts nothing and never imports `sglang`.

The child is `PYTHON -m sglang.launch_server --model-path MODEL ...` (SGLang's own server; the
module, so no PATH lookup) on an internal loopback port. PYTHON is the interpreter of the
environment SGLang is installed in (`resolve_sglang_python`: the configured one, else
`.venv-sglang/bin/python` of this checkout when it exists — `make sglang` builds it — else this
interpreter). `check_sglang_python` is the gate of the replica registry: a backend whose
interpreter cannot find the `sglang` package is not offered (`workers.llm.replicas`).

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

import socket
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.llm.replicas.exceptions import BackendUnavailableError

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
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SGLANG_VENV = REPO_ROOT / ".venv-sglang"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class SGLangReplicaConfig(BaseModel):
    """One SGLang replica: the adapter's address and the SGLang server behind it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Model directory (HF layout: config, safetensors, tokenizer).")
    port: int = Field(ge=1, le=65535, description="Port of the contract adapter.")
    host: str = Field(
        default="127.0.0.1", description="Adapter interface; 0.0.0.0 to serve other machines."
    )
    replica_id: str | None = Field(
        default=None, description="Label of this replica; defaults to '<hostname>:<port>'."
    )
    served_model_name: str | None = Field(
        default=None, description="Model name SGLang serves; defaults to the directory name."
    )
    tp: int = Field(default=1, ge=1, description="Tensor-parallel size.")
    dp: int = Field(default=1, ge=1, description="Data-parallel size (schedulers behind one API).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel size.")
    seed: int = Field(default=0, ge=0, description="SGLang's --random-seed.")
    max_model_len: int | None = Field(default=None, ge=16, description="--context-length cap.")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0, description="--mem-fraction-static (None: SGLang's own)."
    )
    enforce_eager: bool = Field(default=False, description="--disable-cuda-graph: faster start.")
    dtype: str = Field(
        default="float32",
        description="SGLang --dtype: the trainer's precision by default (`rollout replica "
        "serve` derives it), so the replica's logprobs are the ones the trainer recomputes.",
    )
    dtype_reason: str | None = Field(
        default=None, description="Why this dtype, said in one line at start (None: not said)."
    )
    skip_tokenizer_init: bool | None = Field(
        default=None, description="None: skip when the model directory has no tokenizer."
    )
    internal_host: str = Field(default="127.0.0.1", description="SGLang's listening interface.")
    internal_port: int | None = Field(
        default=None, ge=1, le=65535, description="SGLang's port; None picks a free one."
    )
    initial_version: int = Field(default=0, ge=0, description="Policy version of `model`.")
    await_weights: bool = Field(
        default=False,
        description="Wait for broadcast weights before serving (trainer.weight_transfer="
        "broadcast); the sglang backend loads from disk only and refuses to start with it.",
    )
    startup_timeout_s: float = Field(
        default=1200.0, gt=0, description="How long SGLang may take to become healthy."
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="How long pause waits for aborted requests to return."
    )
    python: str | None = Field(
        default=None, description="Interpreter that runs SGLang (None: `resolve_sglang_python`)."
    )
    log_file: str | None = Field(
        default=None,
        description="Where SGLang's output goes (None: $TMPDIR/rollout-sglang-<replica id>.log).",
    )
    extra_args: tuple[str, ...] = Field(
        default=(), description="Further SGLang server arguments, passed through verbatim."
    )

    @model_validator(mode="after")
    def _no_managed_flags_in_extra(self) -> SGLangReplicaConfig:
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise ValueError(f"{flag} is set by the replica launcher; use its own option")
        return self

    def resolved_served_name(self) -> str:
        return self.served_model_name or Path(self.model).name or "model"

    def resolved_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}:{self.port}"


def _has_tokenizer(model_dir: str) -> bool:
    path = Path(model_dir)
    if not path.is_dir():
        return True  # a hub id: SGLang fetches its tokenizer itself
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def resolve_sglang_python(configured: str | None = None) -> str:
    """The interpreter to run SGLang with: `configured`, else .venv-sglang's, else this one."""
    if configured:
        return configured
    default = DEFAULT_SGLANG_VENV / "bin" / "python"
    return str(default) if default.is_file() else sys.executable


def check_sglang_python(configured: str | None = None) -> str:
    """The resolved interpreter; BackendUnavailableError unless it runs and finds `sglang`.

    `find_spec` only locates the package (no import: SGLang's import takes seconds and pulls
    in torch), so the gate is cheap and says nothing about whether SGLang runs on this machine.
    """
    python = resolve_sglang_python(configured)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailableError("sglang", f"cannot run {python}: {exc}") from exc
    if done.returncode != 0:
        raise BackendUnavailableError(
            "sglang",
            f"{python} has no sglang package (build .venv-sglang with `make sglang` where "
            "SGLang runs, or name one with --sglang-python; README: SGLang)",
        )
    return python


def build_sglang_command(
    config: SGLangReplicaConfig, *, internal_port: int, python: str | None = None
) -> list[str]:
    """The argv of the SGLang server child (`python` overrides `config.python`)."""
    cmd = [
        python or resolve_sglang_python(config.python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        config.model,
        "--host",
        config.internal_host,
        "--port",
        str(internal_port),
        "--served-model-name",
        config.resolved_served_name(),
        "--tp-size",
        str(config.tp),
        "--dp-size",
        str(config.dp),
        "--pp-size",
        str(config.pp),
        "--random-seed",
        str(config.seed),
        "--dtype",
        config.dtype,
        "--weight-version",
        str(config.initial_version),
        "--enable-metrics",
    ]
    if config.max_model_len is not None:
        cmd += ["--context-length", str(config.max_model_len)]
    if config.gpu_memory_utilization is not None:
        cmd += ["--mem-fraction-static", str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        cmd.append("--disable-cuda-graph")
    skip = config.skip_tokenizer_init
    if skip is None:
        skip = not _has_tokenizer(config.model)
    if skip:
        cmd.append("--skip-tokenizer-init")
    cmd.extend(config.extra_args)
    return cmd
