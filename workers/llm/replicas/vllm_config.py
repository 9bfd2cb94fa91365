"""Configuration of a `vllm` replica and the `vllm serve` command line it launches.

Pure: builds argument lists and environments, starts nothing and never imports `vllm`.

The child is `PYTHON -m vllm.entrypoints.cli.main serve MODEL ...` (the `vllm serve` console
script's module, so no PATH lookup) on an internal loopback port. PYTHON is the interpreter of
the environment vLLM is installed in, which need not be this process's (`resolve_vllm_python`:
the configured one, else `.venv-vllm/bin/python` of this checkout when it exists — `make vllm`
builds it — else this interpreter). The child gets what the contract needs:
- `--enable-prefix-caching`, so the prefix-cache counters mean something;
- `--served-model-name`, `--seed`, `--max-logprobs` (the contract asks for 0: the sampled token);
- `--tensor-parallel-size / --data-parallel-size / --pipeline-parallel-size`
  (world size = TP x DP x PP GPUs behind one address);
- `VLLM_SERVER_DEV_MODE=1`, which mounts `/pause`, `/resume`, `/is_paused`, `/abort_requests`,
  `/reset_prefix_cache` and `/collective_rpc`;
- `--skip-tokenizer-init` when the model directory has no tokenizer (token ids in and out need
  none; the adapter asks for `return_tokens_as_token_ids`);
- `--worker-extension-cls workers.llm.replicas.vllm_worker.WeightSync`, the weight loader the
  adapter calls (it fixes vLLM's in-place reload for tied embeddings), importable in the child
  because this checkout's root is put first on its PYTHONPATH;
- `--logprobs-mode processed_logprobs`: returned logprobs are those of the distribution the
  token was sampled from (after temperature, top-k/top-p and penalties), which is the behaviour
  policy the trainer's importance weights correct against; vLLM's default, `raw_logprobs`, is
  the model's distribution before temperature.
With `return_routed_experts` (a MoE model) the child also gets `--enable-return-routed-experts`
and `VLLM_USE_V2_MODEL_RUNNER=1`: vLLM returns routing only from its model runner V2, a
generate runner of a MoE model with prefix caching on. vLLM 0.32's CPU build cannot: its V2
runner needs Triton, which has no CPU backend there ("Model Runner V2 requires Triton"), and
without V2 it refuses the flag ("AuxOutput Connector requires Model Runner V2").
Flags the adapter depends on (host, port, served name, parallel sizes, the worker extension,
the logprobs mode, routed experts) may not be overridden through the extra arguments; anything
else is passed through verbatim.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "MANAGED_FLAGS",
    "VLLMLaunchConfig",
    "VLLMReplicaConfig",
    "build_vllm_command",
    "build_vllm_env",
    "has_tokenizer",
    "resolve_vllm_python",
]

MANAGED_FLAGS: frozenset[str] = frozenset(
    {
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--tensor-parallel-size",
        "-tp",
        "--data-parallel-size",
        "-dp",
        "--pipeline-parallel-size",
        "-pp",
        "--worker-extension-cls",
        "--logprobs-mode",
        "--enable-return-routed-experts",
    }
)
WORKER_EXTENSION = "workers.llm.replicas.vllm_worker.WeightSync"
LOGPROBS_MODE = "processed_logprobs"
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VLLM_VENV = REPO_ROOT / ".venv-vllm"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class VLLMLaunchConfig(BaseModel):
    """The run config's `vllm` section: how `rollout replica serve --backend vllm` starts vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str | None = Field(
        default=None,
        description="Interpreter of the environment vLLM is installed in (`--vllm-python`, "
        "ROLLOUT_VLLM__PYTHON); None: .venv-vllm/bin/python of this checkout when it exists "
        "(`make vllm`), else the interpreter of `rollout` itself.",
    )


class VLLMReplicaConfig(BaseModel):
    """One vLLM replica: the adapter's address and the vLLM server behind it."""

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
        default=None, description="Model name vLLM serves; defaults to the directory name."
    )
    tp: int = Field(default=1, ge=1, description="Tensor-parallel size.")
    dp: int = Field(default=1, ge=1, description="Data-parallel size (engines behind one API).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel size.")
    seed: int = Field(default=0, ge=0, description="vLLM's global seed.")
    max_model_len: int | None = Field(default=None, ge=16, description="Context length cap.")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0, description="GPU memory share for vLLM (None: its default)."
    )
    enforce_eager: bool = Field(default=False, description="No CUDA graphs: faster start.")
    dtype: str = Field(
        default="float32",
        description="vLLM --dtype: the trainer's precision by default (`rollout replica serve` "
        "derives it), so the replica's logprobs are the ones the trainer recomputes.",
    )
    dtype_reason: str | None = Field(
        default=None, description="Why this dtype, said in one line at start (None: not said)."
    )
    max_logprobs: int = Field(default=1, ge=0, description="vLLM --max-logprobs.")
    return_routed_experts: bool = Field(
        default=False,
        description="Serve routed experts (a MoE model; vLLM's model runner V2: GPU builds).",
    )
    skip_tokenizer_init: bool | None = Field(
        default=None, description="None: skip when the model directory has no tokenizer."
    )
    internal_host: str = Field(default="127.0.0.1", description="vLLM's listening interface.")
    internal_port: int | None = Field(
        default=None, ge=1, le=65535, description="vLLM's port; None picks a free one."
    )
    initial_version: int = Field(default=0, ge=0, description="Policy version of `model`.")
    await_weights: bool = Field(
        default=False,
        description="Serve nothing until a first weight load (the trainer broadcasts weights).",
    )
    startup_timeout_s: float = Field(
        default=1200.0, gt=0, description="How long vLLM may take to become healthy."
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="How long pause waits for aborted requests to return."
    )
    python: str | None = Field(
        default=None, description="Interpreter that runs vLLM (None: `resolve_vllm_python`)."
    )
    log_file: str | None = Field(
        default=None,
        description="Where vLLM's output goes (None: $TMPDIR/rollout-vllm-<replica id>.log).",
    )
    extra_args: tuple[str, ...] = Field(
        default=(), description="Further `vllm serve` arguments, passed through verbatim."
    )

    @model_validator(mode="after")
    def _no_managed_flags_in_extra(self) -> VLLMReplicaConfig:
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise ValueError(f"{flag} is set by the replica launcher; use its own option")
        return self

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def resolved_served_name(self) -> str:
        return self.served_model_name or Path(self.model).name or "model"

    def resolved_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}:{self.port}"


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds tokenizer files (a hub id, not a directory, counts as yes)."""
    path = Path(model_dir)
    if not path.is_dir():
        return True
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def resolve_vllm_python(configured: str | None = None) -> str:
    """The interpreter to run vLLM with: `configured`, else .venv-vllm's, else this one."""
    if configured:
        return configured
    default = DEFAULT_VLLM_VENV / "bin" / "python"
    return str(default) if default.is_file() else sys.executable


def build_vllm_command(
    config: VLLMReplicaConfig, *, internal_port: int, python: str | None = None
) -> list[str]:
    """The argv of the `vllm serve` child process (`python` overrides `config.python`)."""
    cmd = [
        python or resolve_vllm_python(config.python),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        config.model,
        "--host",
        config.internal_host,
        "--port",
        str(internal_port),
        "--served-model-name",
        config.resolved_served_name(),
        "--tensor-parallel-size",
        str(config.tp),
        "--data-parallel-size",
        str(config.dp),
        "--pipeline-parallel-size",
        str(config.pp),
        "--enable-prefix-caching",
        "--seed",
        str(config.seed),
        "--max-logprobs",
        str(config.max_logprobs),
        "--dtype",
        config.dtype,
        "--disable-uvicorn-access-log",
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--logprobs-mode",
        LOGPROBS_MODE,
    ]
    if config.max_model_len is not None:
        cmd += ["--max-model-len", str(config.max_model_len)]
    if config.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if config.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    skip = config.skip_tokenizer_init
    if skip is None:
        skip = not has_tokenizer(config.model)
    if skip:
        cmd.append("--skip-tokenizer-init")
    cmd.extend(config.extra_args)
    return cmd


def cpu_kv_cache_gib(mem_total_bytes: int | None = None) -> int:
    """The KV cache a CPU vLLM gets unless told (`VLLM_CPU_KVCACHE_SPACE`, GiB): a sixteenth
    of the host's memory, 1 to 8 GiB. Without it vLLM sizes the cache from its GPU default
    (`--gpu-memory-utilization 0.92`), which on a CPU asks for 92% of the host and fails."""
    if mem_total_bytes is None:
        try:
            mem_total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return 1
    return max(1, min(8, mem_total_bytes // (16 << 30)))


def build_vllm_env(
    base: Mapping[str, str] | None = None, *, routed_experts: bool = False
) -> dict[str, str]:
    """The child's environment: the parent's plus dev mode (pause/resume/collective_rpc), this
    checkout first on PYTHONPATH (for the worker extension), a CPU KV cache that fits the
    host unless one is set (a GPU build ignores the variable), and model runner V2 when
    `routed_experts` (the only runner that returns them)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib()))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *(p for p in paths if p != str(REPO_ROOT))]
    )
    return env
