"""The `sglang` contract adapter: the replica contract served in front of one SGLang server,
through SGLang's native API (`/generate` with `input_ids`); `workers.llm.engines.gate`
keeps the gate, pause, drain and update invariants (not yet run against SGLang: README
"SGLang").

What is SGLang's own:
- Pause = `/pause_generation {"mode": "abort"}`; resume = `/continue_generation`. Abort is
  `/abort_request {"rid"}`, one rid a call; where that call fails the HTTP request is
  cancelled (SGLang aborts a non-streamed request whose client left).
- Capacity: SGLang's max running requests over its data-parallel ranks.
- Weights come from disk (`/update_weights_from_disk`, which flushes its prefix cache); a
  broadcast grant (`transfer`) is refused with 400: SGLang's NCCL update group is not wired to
  the trainer's (mapping.py). It returns no routing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import ClientTimeout

from workers.llm.contract import CompletionRequest, CompletionResponse, UpdateWeightsRequest
from workers.llm.engines.gate import GatedAdapter, InFlight
from workers.llm.engines.sglang.mapping import (
    capacity_from_server_info,
    from_sglang_generate,
    map_sglang_error,
    parse_sglang_metrics,
    to_sglang_generate,
    update_from_disk_body,
    upstream_rid,
)
from workers.llm.engines.sglang.upstream import SGLangUpstream
from workers.llm.engines.upstream import UPSTREAM_ERRORS
from workers.metrics import ReplicaCounters

__all__ = ["SGLangAdapter"]

# One weight load from disk, however large the model; the connection itself is quick.
_LOAD_TIMEOUT = ClientTimeout(total=1800.0, sock_connect=30)


class SGLangAdapter(GatedAdapter):
    """Serves the contract on top of one SGLang server at `upstream_url`."""

    backend = "sglang"
    upstream_class = SGLangUpstream
    upstream: SGLangUpstream

    def _refuse(self, req: CompletionRequest) -> str | None:
        return "the sglang backend returns no routing" if req.return_routed_experts else None

    def _upstream_id(self, req: CompletionRequest) -> str:
        return upstream_rid(req.request_id)

    def _generate(self, req: CompletionRequest, upstream_id: str) -> Any:
        body = to_sglang_generate(req, rid=upstream_id)
        return self.upstream.request("POST", "/generate", json=body)

    def _answer(
        self, req: CompletionRequest, data: Any, answer: dict[str, Any]
    ) -> CompletionResponse:
        return from_sglang_generate(data, stop_token_ids=req.stop_token_ids, **answer)

    def _map_error(self, status: int, data: Any) -> dict[str, Any]:
        return map_sglang_error(status, data)

    async def _abort(self, entries: list[InFlight]) -> None:
        async def one(entry: InFlight) -> None:
            try:
                rid = {"rid": entry.upstream_id}
                await self.upstream.request("POST", "/abort_request", json=rid)
            except UPSTREAM_ERRORS as exc:
                self.log.warning("SGLang /abort_request failed (%s); dropping the connection", exc)
                entry.task.cancel()

        await asyncio.gather(*(one(e) for e in entries if not e.task.done()))

    async def _pause_upstream(self) -> bool:
        await self.upstream.control("/pause_generation", {"mode": "abort"})
        return True

    async def _resume_upstream(self) -> None:
        await self.upstream.control("/continue_generation", {})

    def _refuse_update(self, req: UpdateWeightsRequest) -> str | None:
        if req.transfer is not None or not req.path:
            return "the sglang backend loads weights from a path only"
        return None

    async def _load(self, path: str, version: int, grant: dict[str, Any] | None) -> str:
        body = update_from_disk_body(path, version)
        await self.upstream.control("/update_weights_from_disk", body, timeout=_LOAD_TIMEOUT)
        return ""

    def _counters(self, metrics_text: str) -> ReplicaCounters:
        return parse_sglang_metrics(metrics_text)

    def _capacity(self, server_info: Any) -> int | None:
        return capacity_from_server_info(server_info)
