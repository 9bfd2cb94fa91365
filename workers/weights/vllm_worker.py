"""Code that runs *inside* vLLM's worker processes: the weight-sync extension.

`vllm serve --worker-extension-cls workers.weights.vllm_worker.WeightSync` mixes
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

Broadcast weights (`weights.mode: broadcast`): `rollout_receive_weights(grant)`
receives the trainer's transfer over the group its grant names (gloo, or NCCL into the
worker's GPU; `workers.weights.receive.receive_buckets`, torch and the standard library only,
as this module) and loads it bucket by bucket into the live weights: the received tensors are
the weights iterator of vLLM's own reload, so the next bucket is received only when the reload
asks for it and a bucket is dropped once loaded. The extra memory is the bucket being received
and the one being loaded (plus what vLLM's layer-by-layer reload buffers for a layer whose
tensors span two buckets), whatever the model's size: never a copy of the whole model on the
GPU, outside vLLM's memory budget. The tensors arrive in the dtype the replica serves (its
want says it). The names are the trainer's state-dict names, which for the project's dense
models are the checkpoint's; a Mixture-of-Experts model, whose transformers layout stacks the
experts, is not converted.

Both loads go through the worker's own `reload_weights` (vLLM's `Worker.reload_weights`),
never `model_runner.reload_weights` directly: the worker's method sets the current vLLM config
(the fused-MoE path asserts without it) and, in vLLM 0.34, lends the KV cache's memory to the
layer-by-layer update; called outside it, an update can run out of memory part-way.

Contract: `rollout_load_weights` returns `{"reprocessed": [module names], "parameters": n}`,
`rollout_receive_weights` the same plus `received` (tensors), `buckets` and `rank`, or `error`
when the transfer did not arrive: with `received: 0` when nothing was loaded (the served
weights are whole), with `partial: true` when it failed after loading began (the layers not
reached keep their old tensors: the model is neither version, and the adapter serves nothing
until the next load). Any other exception propagates to `/collective_rpc` as an HTTP error.
Given `report_dir` (the adapter always gives one), each worker also writes its report there as
`<index>.json` (index: dp x world + rank): with data parallelism vLLM runs the method on every
engine but `/collective_rpc` answers with engine 0's results only.
This module imports only torch, vllm and `workers.weights`, and only inside the worker (never
in the adapter or the trainer).
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
    """Mixed into vLLM's `Worker` (which provides `model_runner`, `model_config` and
    `reload_weights`); called via collective_rpc."""

    model_runner: Any
    model_config: Any

    def rollout_load_weights(
        self, weights_path: str, report_dir: str | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at `weights_path` in place, tied layers included."""
        return _filed(self, report_dir, self._rollout_reload(weights_path=weights_path))

    def rollout_receive_weights(
        self, grant: dict[str, Any], report_dir: str | None = None
    ) -> dict[str, Any]:
        """`_rollout_receive`, its report also filed in `report_dir` (the module docstring)."""
        return _filed(self, report_dir, self._rollout_receive(grant))

    def _rollout_receive(self, grant: dict[str, Any]) -> dict[str, Any]:
        """Receive the trainer's granted transfer over its group and load it bucket by bucket
        (module docstring); each worker takes its own rank of the group (its index across
        data-parallel engines, as vLLM's NCCL weight transfer numbers them). Nothing is loaded
        before the first bucket has arrived."""
        from workers.weights.receive import receive_buckets

        index = _worker_index(self)
        device = getattr(self, "device", "cpu") if grant.get("backend") == "nccl" else "cpu"
        rank = int(grant["rank"]) + index
        stream = receive_buckets(grant, rank_offset=index, device=device)
        try:
            first = next(stream, None)  # joins, forms the group, takes bucket 0
        except (ValueError, RuntimeError) as exc:  # nothing loaded: the adapter says why
            return {"error": _brief(exc), "received": 0, "rank": rank}
        held = [first]
        del first
        counts = {"received": 0, "buckets": 0}

        def weights() -> Any:
            bucket = held.pop()
            while bucket is not None:
                counts["buckets"] += 1
                for name, tensor in bucket.items():
                    counts["received"] += 1
                    yield name, tensor
                # Dropped before the next is received: only vLLM's own references remain.
                bucket = tensor = None
                bucket = next(stream, None)

        try:
            report = self._rollout_reload(weights_iterator=weights())
            # A reload that stopped early left buckets unread: the model misses them.
            if left := sum(1 for _ in stream):
                raise RuntimeError(f"the reload stopped with {left} buckets not read")
        except (ValueError, RuntimeError) as exc:
            self._rollout_restore()
            return {"error": _brief(exc), "partial": True, "rank": rank, **counts}
        finally:
            stream.close()  # a transfer left half-way is aborted, never left to a destructor
        return report | counts | {"rank": rank}

    def _rollout_restore(self) -> None:
        """After a reload that failed part-way: the layers it did not reach get their old
        tensors back (vLLM's layerwise finalisation), instead of staying on the meta device."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import (
                finalize_layerwise_reload,
            )

            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
        except (ImportError, AttributeError, RuntimeError):
            pass  # another vLLM: the adapter serves nothing until the next load anyway

    def _rollout_reload(self, **source: Any) -> dict[str, Any]:
        """vLLM's in-place `reload_weights` from `source` (through the worker's method), then
        the tied-layer fix."""
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        reload = getattr(self, "reload_weights", None)  # vLLM's Worker method (docstring)
        if callable(reload):
            reload(**source)
        else:
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


def _worker_index(worker: Any) -> int:
    """The worker's index across the replica's data-parallel engines: dp x world + rank."""
    parallel = getattr(worker, "parallel_config", None)
    if parallel is None:
        return 0
    dp = int(getattr(parallel, "data_parallel_index", 0) or 0)
    return dp * int(parallel.world_size) + int(parallel.rank)


def _filed(worker: Any, report_dir: str | None, report: dict[str, Any]) -> dict[str, Any]:
    """`report`, also written to `report_dir/<worker index>.json` when given: with data
    parallelism vLLM's `/collective_rpc` runs the method on every engine but answers with
    engine 0's results only, so the adapter reads every worker's report from there."""
    if report_dir:
        import json
        import os

        path = os.path.join(report_dir, f"{_worker_index(worker)}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as out:
            json.dump(report, out)
        os.replace(path + ".tmp", path)  # never read half-written
    return report


def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[-300:]}"
