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

Contract: `rollout_load_weights` returns `{"reprocessed": [module names], "parameters": n}`;
any exception propagates to `/collective_rpc` as an HTTP error. This module imports only
torch and vllm, and only inside the worker (never in the adapter or the trainer).
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
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        self.model_runner.reload_weights(weights_path=weights_path)
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
