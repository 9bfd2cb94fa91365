"""Code that runs *inside* vLLM's worker processes: the weight-sync extension.

`vllm serve --worker-extension-cls workers.llm.replicas.vllm_worker.WeightSync` mixes
`WeightSync` into vLLM's worker class, and the adapter calls its method over HTTP:
`POST /collective_rpc {"method": "rollout_load_weights", "kwargs": {"weights_path": DIR}}`.
Every worker (TP/PP ranks, DP engines) loads the checkpoint and answers one JSON object.

Why not vLLM's own `reload_weights` alone: vLLM 0.32 reloads layer by layer
(`model_executor/model_loader/reload/layerwise.py`): each layer's parameters are put on the
meta device, refilled from the checkpoint, *processed* (`quant_method.
process_weights_after_loading`) and copied back into the original storage. With tied word
embeddings the checkpoint holds `model.embed_tokens.weight` only and the model's
`load_weights` skips any `lm_head.weight`, so `ParallelLMHead` receives no tensor: vLLM logs
"ParallelLMHead: Failed to load weights" and puts its old tensors back. The values are right
anyway (the head's weight *is* the embedding's Parameter, which was updated), but the head
is never processed again, and what it computes with is that processing's output. On CPUs it
is `dispatch_cpu_unquantized_gemm`, which packs a copy of the weight for the sgl-kernel /
oneDNN GEMM (`layer.cpu_linear`), so logits keep coming from the *old* head while the
embedding is new: a policy that is neither version. Untied models load `lm_head.weight`, get
processed, and are right. So after the reload this extension processes again every
unquantized embedding-style layer whose weight is shared with another module (the tied
head): on CPUs that repacks the new weight, on GPUs the method does nothing.

Broadcast weights (`trainer.weight_transfer: broadcast`): `rollout_receive_weights(grant)`
receives the trainer's transfer over the group its grant names (`workers.transfer.receive`,
gloo; torch and the standard library only, as this module) and loads it through the same
`reload_weights`, from an iterator of the received tensors instead of a path. The names are
the trainer's state-dict names, which for the project's dense models are the checkpoint's;
a Mixture-of-Experts model, whose transformers layout stacks the experts, is not converted.

Contract: `rollout_load_weights` returns `{"reprocessed": [module names], "parameters": n}`,
`rollout_receive_weights` the same plus `received` (tensors) and `rank`, or `error` when the
transfer did not arrive (nothing loaded); any other exception propagates to `/collective_rpc`
as an HTTP error. This module imports only torch, vllm and
`workers.transfer`, and only inside the worker (never in the adapter or the trainer).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WeightSync", "shared_weight_layers"]


def shared_weight_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of each module whose `weight` Parameter another module also holds."""
    owners: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append((name, module))
    shared: list[tuple[str, Any]] = []
    for group in owners.values():
        if len(group) > 1:
            shared.extend(group)
    return shared


class WeightSync:
    """Mixed into vLLM's `Worker` (which provides `model_runner`); called via collective_rpc."""

    model_runner: Any

    def rollout_load_weights(self, weights_path: str) -> dict[str, Any]:
        """Load the checkpoint at `weights_path` in place, tied layers included."""
        return self._rollout_reload(weights_path=weights_path)

    def rollout_receive_weights(self, grant: dict[str, Any]) -> dict[str, Any]:
        """Receive the trainer's granted transfer (`workers.transfer.receive`) over its group
        and load it in place like a checkpoint; each worker takes its own rank of the group
        (its index across data-parallel engines, as vLLM's NCCL weight transfer numbers them).
        Everything is received before anything is loaded: a transfer that fails half-way
        leaves the served weights whole."""
        from workers.transfer.receive import receive

        parallel = getattr(self, "parallel_config", None)
        index = 0
        if parallel is not None:
            dp = int(getattr(parallel, "data_parallel_index", 0) or 0)
            index = dp * int(parallel.world_size) + int(parallel.rank)
        device = getattr(self, "device", "cpu") if grant.get("backend") == "nccl" else "cpu"
        # Received into buffers kept for the next transfer (CPU ones only: a GPU's memory
        # is vLLM's KV cache).
        pool = None if device != "cpu" else self.__dict__.setdefault("_rollout_buffers", [])
        try:
            state = receive(grant, rank_offset=index, device=device, pool=pool)
        except (ValueError, RuntimeError) as exc:  # nothing loaded: the adapter says why
            return {"error": f"{type(exc).__name__}: {str(exc).strip()[-300:]}", "received": 0}
        report = self._rollout_reload(weights_iterator=iter(state.items()))
        return report | {"received": len(state), "rank": int(grant["rank"]) + index}

    def _rollout_reload(self, **source: Any) -> dict[str, Any]:
        """vLLM's in-place `reload_weights` from `source`, then the tied-layer fix."""
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        self.model_runner.reload_weights(**source)
        model = self.model_runner.get_model()
        reprocessed: list[str] = []
        with torch.no_grad():
            for name, module in shared_weight_layers(model):
                method = getattr(module, "quant_method", None)
                # Only the unquantized method: processing it again is idempotent (it
                # derives kernels from `weight` and leaves `weight` itself unchanged).
                if isinstance(method, UnquantizedEmbeddingMethod):
                    method.process_weights_after_loading(module)
                    reprocessed.append(name)
        return {
            "reprocessed": reprocessed,
            "parameters": sum(1 for _ in model.parameters()),
        }
