"""What every replica that launches an inference server as its child is configured with
(`VLLMReplicaConfig`, `SGLangReplicaConfig` extend it), and how its interpreter is found.

Pure: starts nothing and imports no engine. The engine runs in an interpreter of its own
environment (`resolve_python`: the configured one, else `<checkout>/.venv-<backend>/bin/python`
when it exists — `make vllm` / `make sglang` build it — else this interpreter); `check_python`
finds the engine's package there without importing it (cheap, and says nothing about whether
the engine runs on this machine).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.llm.engines.exceptions import BackendUnavailableError

__all__ = [
    "REPO_ROOT",
    "ServedReplicaConfig",
    "ServerFlags",
    "check_python",
    "has_tokenizer",
    "resolve_python",
    "server_command",
]

REPO_ROOT = Path(__file__).resolve().parents[3]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ServedReplicaConfig(BaseModel):
    """One replica: the adapter's address and the engine's server behind it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: Flags the launcher sets itself; `extra_args` may not name them.
    managed_flags: ClassVar[frozenset[str]] = frozenset()

    model: str = Field(description="Model directory (HF layout: config, safetensors, tokenizer).")
    port: int = Field(ge=1, le=65535, description="Port of the contract adapter.")
    host: str = Field(
        default="127.0.0.1", description="Adapter interface; 0.0.0.0 to serve other machines."
    )
    replica_id: str | None = Field(
        default=None, description="Label of this replica; defaults to '<hostname>:<port>'."
    )
    served_model_name: str | None = Field(
        default=None, description="Model name the engine serves; defaults to the directory name."
    )
    tp: int = Field(default=1, ge=1, description="Tensor-parallel size.")
    dp: int = Field(default=1, ge=1, description="Data-parallel size (engines behind one API).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel size.")
    seed: int = Field(default=0, ge=0, description="The engine's random seed.")
    max_model_len: int | None = Field(default=None, ge=16, description="Context length cap.")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0, description="GPU memory share (None: the engine's own)."
    )
    enforce_eager: bool = Field(default=False, description="No CUDA graphs: faster start.")
    dtype: str = Field(
        default="float32",
        description="The engine's --dtype: the trainer's precision by default (`rollout replica "
        "serve` derives it), so the replica's logprobs are the ones the trainer recomputes.",
    )
    dtype_reason: str | None = Field(
        default=None, description="Why this dtype, said in one line at start (None: not said)."
    )
    skip_tokenizer_init: bool | None = Field(
        default=None, description="None: skip when the model directory has no tokenizer."
    )
    internal_host: str = Field(default="127.0.0.1", description="The engine's interface.")
    internal_port: int | None = Field(
        default=None, ge=1, le=65535, description="The engine's port; None picks a free one."
    )
    initial_version: int = Field(default=0, ge=0, description="Policy version of `model`.")
    await_weights: bool = Field(
        default=False,
        description="Serve nothing until a first weight load (the trainer broadcasts weights).",
    )
    startup_timeout_s: float = Field(
        default=1200.0, gt=0, description="How long the engine may take to become healthy."
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="How long pause waits for aborted requests to return."
    )
    python: str | None = Field(
        default=None, description="Interpreter that runs the engine (None: `resolve_python`)."
    )
    log_file: str | None = Field(
        default=None,
        description="Where the engine's output goes (None: $TMPDIR/rollout-<backend>-<id>.log).",
    )
    extra_args: tuple[str, ...] = Field(
        default=(), description="Further server arguments, passed through verbatim."
    )

    @model_validator(mode="after")
    def _no_managed_flags_in_extra(self) -> Self:
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in self.managed_flags:
                raise ValueError(f"{flag} is set by the replica launcher; use its own option")
        return self

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def resolved_served_name(self) -> str:
        return self.served_model_name or Path(self.model).name or "model"

    def resolved_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}:{self.port}"

    def adapter_settings(self, internal_port: int) -> dict[str, Any]:
        """The keyword arguments of the `GatedAdapter` in front of the engine's server on
        `internal_port` that every backend sets alike (a backend adds its own)."""
        return {
            "upstream_url": f"http://{self.internal_host}:{internal_port}",
            "replica_id": self.resolved_replica_id(),
            "served_model_name": self.resolved_served_name(),
            "initial_version": self.initial_version,
            "drain_timeout_s": self.drain_timeout_s,
        }


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds tokenizer files (a hub id, not a directory, counts as yes:
    the engine fetches its tokenizer itself)."""
    path = Path(model_dir)
    if not path.is_dir():
        return True
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def resolve_python(configured: str | None, venv: Path) -> str:
    """The interpreter to run an engine with: `configured`, else `venv`'s, else this one."""
    if configured:
        return configured
    default = venv / "bin" / "python"
    return str(default) if default.is_file() else sys.executable


def check_python(python: str, package: str, backend: str, hint: str) -> None:
    """BackendUnavailableError (ending with `hint`) unless `python` runs and finds `package`."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailableError(backend, f"cannot run {python}: {exc}") from exc
    if done.returncode != 0:
        raise BackendUnavailableError(backend, f"{python} has no {package} module ({hint})")


@dataclass(frozen=True)
class ServerFlags:
    """How one server's command line spells what every served replica sets."""

    launch: tuple[str, ...]  # after the interpreter: the module and its subcommand
    model: str | None  # the model directory's flag; None: a positional argument
    tp: str
    dp: str
    pp: str
    seed: str
    context: str  # max_model_len
    memory: str  # gpu_memory_utilization
    eager: str  # enforce_eager: no graph capture


def server_command(
    config: ServedReplicaConfig,
    flags: ServerFlags,
    *,
    python: str,
    internal_port: int,
    own: list[str],
) -> list[str]:
    """The argv of a server behind its adapter: what every served replica sets, spelt by
    `flags`, then the engine's `own` arguments, the optional settings, the tokenizer skip
    (none in the model directory) and `extra_args` last, as given."""
    model = [flags.model, config.model] if flags.model else [config.model]
    cmd = [
        python, *flags.launch, *model,
        "--host", config.internal_host,
        "--port", str(internal_port),
        "--served-model-name", config.resolved_served_name(),
        flags.tp, str(config.tp),
        flags.dp, str(config.dp),
        flags.pp, str(config.pp),
        flags.seed, str(config.seed),
        "--dtype", config.dtype,
        *own,
    ]  # fmt: skip
    if config.max_model_len is not None:
        cmd += [flags.context, str(config.max_model_len)]
    if config.gpu_memory_utilization is not None:
        cmd += [flags.memory, str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        cmd.append(flags.eager)
    skip = config.skip_tokenizer_init
    if skip is None:
        skip = not has_tokenizer(config.model)
    if skip:
        cmd.append("--skip-tokenizer-init")
    return [*cmd, *config.extra_args]
