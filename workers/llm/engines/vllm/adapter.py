"""The `vllm` contract adapter: the replica contract served in front of one vLLM server
(`workers.llm.engines.gate` keeps the gate, pause, drain and update invariants).

What is vLLM's own:
- Pause is vLLM `/pause?mode=abort` (when dev mode has it); abort is `/abort_requests` with
  vLLM's engine ids (never an empty list: vLLM reads it as "abort everything"); where vLLM
  lacks that endpoint the HTTP request is cancelled (vLLM aborts on client disconnect).
- Weights load through the project's worker extension (`collective_rpc`, from disk or as a
  broadcast grant), then `/reset_prefix_cache`: KV of the old weights is never reused.
- Capacity: vLLM's resolved `max_num_seqs` × data-parallel size.
- Routed experts are served only when vLLM was started to return them (`num_experts` given:
  `return_routed_experts` in `VLLMReplicaConfig`); a request that asks for them otherwise gets
  400 with the reason, never a response without them. Responses to requests that did not ask
  drop vLLM's routing (it returns it for every request once on).
"""

from __future__ import annotations

import uuid
from typing import Any

from workers.llm.contract import CompletionRequest, CompletionResponse
from workers.llm.engines.gate import GatedAdapter, InFlight
from workers.llm.engines.upstream import UPSTREAM_ERRORS
from workers.llm.engines.vllm.mapping import (
    GENERATE_PATH,
    VLLMMetrics,
    capacity_from_server_info,
    collapse_image_placeholders,
    engine_request_id,
    from_vllm_completion,
    generate_as_completion,
    generate_engine_id,
    map_vllm_error,
    parse_vllm_metrics,
    to_vllm_completion,
    to_vllm_generate,
)
from workers.llm.engines.vllm.upstream import VLLMUpstream, VLLMUpstreamError
from workers.weights.exceptions import WeightTransferError

__all__ = ["VLLMAdapter"]

_NO_ROUTING = (
    "return_routed_experts: this vLLM replica does not return routing (start it with "
    "--routed-experts, for a Mixture-of-Experts model on a vLLM build with model runner V2)"
)


class VLLMAdapter(GatedAdapter):
    """Serves the contract on top of one vLLM server at `upstream_url`."""

    backend = "vllm"
    takes_images = True  # through GENERATE_PATH (mapping.to_vllm_generate)
    transfer_backends = ("gloo", "nccl")  # its workers receive (vllm_worker.WeightSync)
    upstream_class = VLLMUpstream
    upstream: VLLMUpstream

    def __init__(
        self,
        *,
        num_experts: int | None = None,
        image_token_id: int | None = None,
        **gate: Any,
    ) -> None:
        """`gate`: the `GatedAdapter` settings (`upstream_url`, `replica_id`, ...)."""
        super().__init__(**gate)
        self.num_experts = num_experts  # experts per MoE layer when vLLM returns routing
        # The model's image placeholder: vLLM expands it itself, so each expanded run goes
        # back to one (mapping.collapse_image_placeholders).
        self.image_token_id = image_token_id

    def _refuse(self, req: CompletionRequest) -> str | None:
        if req.return_routed_experts and self.num_experts is None:
            return _NO_ROUTING
        # Checked here, not when the body is built: that runs after the gate, where a
        # ValueError would be a 500 with a traceback instead of this 400.
        if missing := [i.sha256[:12] for i in req.images or [] if i.data is None]:
            return f"images: {', '.join(missing)} without their bytes inline (the contract's rule)"
        if req.images and self.image_token_id is not None:
            try:
                collapse_image_placeholders(req.prompt, self.image_token_id, len(req.images))
            except ValueError as exc:
                return str(exc)
        return None

    def _upstream_id(self, req: CompletionRequest) -> str:
        return f"{req.request_id or 'req'}-{uuid.uuid4().hex[:12]}"

    def _engine_id(self, req: CompletionRequest, upstream_id: str) -> str:
        return generate_engine_id(upstream_id) if req.images else engine_request_id(upstream_id)

    def _generate(self, req: CompletionRequest, upstream_id: str) -> Any:
        model = self.served_model_name
        if req.images:
            body = to_vllm_generate(
                req, model=model, upstream_id=upstream_id, image_token_id=self.image_token_id
            )
            return self.upstream.request("POST", GENERATE_PATH, json=body)
        body = to_vllm_completion(req, model=model, upstream_id=upstream_id)
        return self.upstream.request("POST", "/v1/completions", json=body)

    def _answer(
        self, req: CompletionRequest, data: Any, answer: dict[str, Any]
    ) -> CompletionResponse:
        if req.images:
            data = generate_as_completion(data)
        return from_vllm_completion(
            data,
            policy_version=answer["policy_version"],
            want_logprobs=answer["want_logprobs"],
            request_id=req.request_id,
            num_experts=self.num_experts if req.return_routed_experts else None,
        )

    def _map_error(self, status: int, data: Any) -> dict[str, Any]:
        return map_vllm_error(status, data)

    async def _abort(self, entries: list[InFlight]) -> None:
        live = [e for e in entries if not e.task.done()]
        if not live:
            return  # never send an empty list: vLLM reads it as "abort everything"
        try:
            ids = [e.engine_id for e in live]
            result = await self.upstream.dev("/abort_requests", json={"request_ids": ids})
        except UPSTREAM_ERRORS as exc:
            self.log.warning("vLLM /abort_requests failed (%s); dropping the connections", exc)
            result = None
        if result is None:
            for e in live:
                e.task.cancel()

    async def _pause_upstream(self) -> bool:
        return await self.upstream.dev("/pause", params={"mode": "abort"}) is not None

    async def _resume_upstream(self) -> None:
        await self.upstream.dev("/resume")

    async def _load(self, path: str, version: int, grant: dict[str, Any] | None) -> str:
        if grant is None:
            reports = await self.upstream.reload_weights(path)
        else:
            reports = await self.upstream.receive_weights(grant)
        if len(reports) < self.receivers:  # a worker (another engine's) that did not report
            raise VLLMUpstreamError(
                f"{len(reports)} of the replica's {self.receivers} vLLM workers reported a load"
            )
            if partial := [str(r["error"]) for r in reports if r.get("partial")]:
                # Loading had begun: the model is neither version; it serves nothing until
                # the next load (GatedAdapter.weights_error).
                raise VLLMUpstreamError(f"transfer failed part-way: {partial[0]}")
            if failed := [str(r["error"]) for r in reports if r.get("error")]:
                raise WeightTransferError(f"transfer failed: {failed[0]}")
        # KV computed by the old weights must never be reused by the new ones.
        if await self.upstream.dev("/reset_prefix_cache") is None:
            self.log.warning("vLLM has no /reset_prefix_cache; relying on /pause to clear it")
        tied = sorted({name for r in reports for name in r.get("reprocessed", [])})
        return f" ({len(reports)} workers; tied layers reprocessed: {tied})"

    def _counters(self, metrics_text: str) -> VLLMMetrics:
        return parse_vllm_metrics(metrics_text)

    def _capacity(self, server_info: Any) -> int | None:
        return capacity_from_server_info(server_info)
