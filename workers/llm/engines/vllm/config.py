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
  (world size = TP x DP x PP GPUs behind one address); with DP > 1 `--api-server-count 1`:
  vLLM would start one API server per DP rank, and an abort (or pause) sent to one of them
  for a request another holds is answered 200 and does nothing;
- `VLLM_SERVER_DEV_MODE=1`, which mounts `/pause`, `/resume`, `/is_paused`, `/abort_requests`,
  `/reset_prefix_cache` and `/collective_rpc`;
- `--skip-tokenizer-init` when the model directory has no tokenizer (token ids in and out need
  none; the adapter asks for `return_tokens_as_token_ids`);
- `--worker-extension-cls workers.weights.vllm_worker.WeightSync`, the weight loader the
  adapter calls (it fixes vLLM's in-place reload for tied embeddings), importable in the child
  because this checkout's root is put first on its PYTHONPATH;
- `--enable-scale-out` for a vision-language model (`vision_config` in its config.json): its
  `/inference/v1/generate` is the route that takes token ids and images together;
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

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from workers.llm.engines.served_config import (
    REPO_ROOT,
    ServedReplicaConfig,
    ServerFlags,
    has_tokenizer,
    resolve_python,
    server_command,
)
from workers.weights.protocol import NCCL_SHARED_ENV

__all__ = [
    "MANAGED_FLAGS",
    "VLLMLaunchConfig",
    "VLLMReplicaConfig",
    "build_vllm_command",
    "build_vllm_env",
    "has_tokenizer",
    "image_token_id",
    "resolve_vllm_python",
    "takes_images",
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
        "--api-server-count",
        "-asc",
    }
)
WORKER_EXTENSION = "workers.weights.vllm_worker.WeightSync"
LOGPROBS_MODE = "processed_logprobs"
DEFAULT_VLLM_VENV = REPO_ROOT / ".venv-vllm"


class VLLMLaunchConfig(BaseModel):
    """The run config's `vllm` section: how `rollout replica serve --backend vllm` starts vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str | None = Field(
        default=None,
        description="Interpreter of the environment vLLM is installed in (`--vllm-python`, "
        "ROLLOUT_VLLM__PYTHON); None: .venv-vllm/bin/python of this checkout when it exists "
        "(`make vllm`), else the interpreter of `rollout` itself.",
    )


class VLLMReplicaConfig(ServedReplicaConfig):
    """One vLLM replica: the adapter's address and the vLLM server behind it."""

    managed_flags: ClassVar[frozenset[str]] = MANAGED_FLAGS

    max_logprobs: int = Field(default=1, ge=0, description="vLLM --max-logprobs.")
    return_routed_experts: bool = Field(
        default=False,
        description="Serve routed experts (a MoE model; vLLM's model runner V2: GPU builds).",
    )


def resolve_vllm_python(configured: str | None = None) -> str:
    """The interpreter to run vLLM with: `configured`, else .venv-vllm's, else this one."""
    return resolve_python(configured, DEFAULT_VLLM_VENV)


VLLM_FLAGS = ServerFlags(
    launch=("-m", "vllm.entrypoints.cli.main", "serve"),
    model=None,
    tp="--tensor-parallel-size",
    dp="--data-parallel-size",
    pp="--pipeline-parallel-size",
    seed="--seed",
    context="--max-model-len",
    memory="--gpu-memory-utilization",
    eager="--enforce-eager",
)


def build_vllm_command(
    config: VLLMReplicaConfig, *, internal_port: int, python: str | None = None
) -> list[str]:
    """The argv of the `vllm serve` child process (`python` overrides `config.python`)."""
    own = [
        "--enable-prefix-caching",
        "--max-logprobs", str(config.max_logprobs),
        "--disable-uvicorn-access-log",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--logprobs-mode", LOGPROBS_MODE,
    ]  # fmt: skip
    if config.return_routed_experts:
        own.append("--enable-return-routed-experts")
    if config.dp > 1:
        # vLLM starts an API server per DP rank otherwise, and an abort sent to one of them
        # for a request another holds is answered 200 and does nothing.
        own += ["--api-server-count", "1"]
    if takes_images(config.model):
        own.append("--enable-scale-out")  # its token-in generate route is the one with images
    return server_command(
        config,
        VLLM_FLAGS,
        python=python or resolve_vllm_python(config.python),
        internal_port=internal_port,
        own=own,
    )


def takes_images(model_dir: str | Path) -> bool:
    """Whether the model directory holds a vision-language model (`vision_config` in its
    config.json); a hub id or an unreadable config counts as no."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def image_token_id(model_dir: str | Path) -> int | None:
    """The image placeholder's token id of a vision-language model directory
    (`image_token_index`, or `image_token_id` as newer configs spell it); None for a text model,
    a hub id or an unreadable config. The adapter cuts each image's expanded run of it back to
    one before vLLM (`mapping.collapse_image_placeholders`)."""
    if not takes_images(model_dir):
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("image_token_index", "image_token_id"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


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
    host unless one is set (a GPU build ignores the variable), model runner V2 when
    `routed_experts` (the only runner that returns them), and the NCCL settings a trainer's
    NCCL weight transfer must share with vLLM's workers (`NCCL_SHARED_ENV`: NCCL reads them
    once per process, so they are set before vLLM starts, whatever vLLM's version sets)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(NCCL_SHARED_ENV)
    if routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib()))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *(p for p in paths if p != str(REPO_ROOT))]
    )
    return env
