"""The `vllm` replica backend: launch `vllm serve` and serve the replica contract in front of it.

Started by `rollout replica serve --backend vllm --model DIR --port P [--tp N --dp N --pp N]
[--vllm-python PY] [--vllm-arg ARG ...]`, the one command line (`pipeline.cli.stages`); this
module has none of its own. The adapter runs in that process, under `rollout`'s interpreter;
only the vLLM child runs in vLLM's environment.

Process model (`workers.llm.engines.child_server`): this process runs the aiohttp adapter
(`VLLMAdapter`) on `--port` at once, then vLLM as a child in its own process group on a
loopback port; no vLLM server outlives its adapter. Importing this module never imports
`vllm`: only the child does, in the interpreter `--vllm-python` names (see
`resolve_vllm_python`); one that does not exist or has no `vllm` raises
`BackendUnavailableError` before anything starts. A vLLM that fails to start raises
`ReplicaStartError` with the one line that says why (`child_output.root_cause`).
"""

from __future__ import annotations

import sys

from workers.llm.engines.child_output import root_cause
from workers.llm.engines.child_server import run_behind_adapter, served_by
from workers.llm.engines.exceptions import ReplicaStartError
from workers.llm.engines.served_config import check_python
from workers.llm.engines.vllm.adapter import VLLMAdapter
from workers.llm.engines.vllm.config import (
    VLLMReplicaConfig,
    build_vllm_command,
    build_vllm_env,
    image_token_id,
    resolve_vllm_python,
)
from workers.llm.moe import experts_per_layer
from workers.ports import free_port

__all__ = [
    "BACKEND",
    "VLLMAdapter",
    "VLLMReplicaConfig",
    "serve",
    "serve_async",
]

BACKEND = "vllm"


async def serve_async(config: VLLMReplicaConfig) -> int:
    """Run one replica until SIGTERM/SIGINT or until vLLM exits; returns the exit status."""
    python = resolve_vllm_python(config.python)
    check_python(python, "vllm", BACKEND, "build one with `make vllm`, or --vllm-python")
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
        **config.adapter_settings(internal_port),
        num_experts=num_experts,
        await_weights=config.await_weights,
        receivers=config.world_size,
        dtype=None if config.dtype == "auto" else config.dtype,  # "auto": vLLM's choice
        image_token_id=image_token_id(config.model),
    )
    return await run_behind_adapter(
        adapter,
        host=config.host,
        port=config.port,
        cmd=build_vllm_command(config, internal_port=internal_port, python=python),
        env=build_vllm_env(routed_experts=config.return_routed_experts),
        log_file=config.log_file,
        startup_timeout_s=config.startup_timeout_s,
        start_failure=root_cause,
    )


#: The registry's entry: `serve(model_dir, host, port, replica_id, version, **options)`.
serve = served_by(VLLMReplicaConfig, serve_async)
