"""A thin async client of one vLLM OpenAI-compatible server (the adapter's upstream).

It knows vLLM's endpoint names and which ones this server lacks: a dev-mode endpoint that
answers 404 once is remembered as absent and never called again (`dev` returns None), so
the adapter can fall back (older vLLM, or dev mode off). Endpoints used, all under
`VLLM_SERVER_DEV_MODE=1` except the first three:
`/health`, `/v1/models`, `/metrics`, `/v1/completions`, `/abort_requests {request_ids}`,
`/pause?mode=abort`, `/resume`, `/reset_prefix_cache`, `/collective_rpc {method, args, kwargs}`,
`GET /server_info` (the resolved config, read once for the replica's capacity).

Weight reload from disk goes through `collective_rpc` to the project's worker extension
(`workers.weights.vllm_worker.WeightSync`, which the launcher always installs):
`rollout_load_weights(weights_path=...)`, vLLM's in-place `reload_weights` plus the tied-head
fix explained there; broadcast weights through `rollout_receive_weights(grant=...)`. There is
deliberately no fallback to a bare `reload_weights`: on a model with tied embeddings it would
answer 200 and serve a head of the previous version.

Each call names a fresh directory (`report_dir`) where every worker also files its report:
with data parallelism vLLM runs the method on every engine but answers with engine 0's
results only, so the reports are read from there (the workers are on this node: a replica
runs within one).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from workers.llm.engines.upstream import UPSTREAM_ERRORS, Upstream
from workers.llm.engines.vllm.mapping import VLLMUpstreamError

__all__ = ["RECEIVE_METHOD", "UPSTREAM_ERRORS", "WEIGHT_SYNC_METHOD", "VLLMUpstream"]

logger = logging.getLogger("rollout.replica.vllm")

WEIGHT_SYNC_METHOD = "rollout_load_weights"  # WeightSync's method, called by name
RECEIVE_METHOD = "rollout_receive_weights"  # its broadcast twin (`weights.mode`)


class VLLMUpstream(Upstream):
    """HTTP calls to vLLM at `base_url`; open with `start()`, close with `close()`. Its first
    `/server_info` also gathers vLLM's system report, which takes a few seconds."""

    engine = "vLLM"
    error = VLLMUpstreamError
    server_info_params: ClassVar[dict[str, str] | None] = {"config_format": "json"}

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self._has: dict[str, bool] = {}

    async def dev(self, path: str, **kwargs: Any) -> tuple[int, Any] | None:
        """POST a dev-mode endpoint; None when this vLLM does not have it (404, remembered)."""
        if self._has.get(path) is False:
            return None
        status, body = await self.request("POST", path, **kwargs)
        if status == 404:
            logger.warning("vLLM has no %s; using the adapter's fallback", path)
            self._has[path] = False
            return None
        self._has[path] = True
        if status >= 400:
            raise VLLMUpstreamError(f"vLLM {path} answered {status}: {body!r:.300}")
        return status, body

    async def reload_weights(self, path: str) -> list[dict[str, Any]]:
        """Load the checkpoint at `path` into every worker (the engine should be paused).

        Returns each worker's report (`WeightSync.rollout_load_weights`); raises
        `VLLMUpstreamError` when vLLM refuses or a worker did not report.
        """
        return await self._rpc(WEIGHT_SYNC_METHOD, {"weights_path": path})

    async def receive_weights(self, grant: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker receives the trainer's granted transfer and loads it (paused engine);
        each worker's report, as `reload_weights`."""
        return await self._rpc(RECEIVE_METHOD, {"grant": grant})

    async def _rpc(self, method: str, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker's report: those filed in a directory of this call's (all engines'),
        else the answer's (engine 0's only, when vLLM runs data-parallel engines)."""
        reports = Path(tempfile.mkdtemp(prefix="rollout-vllm-rpc-"))
        try:
            status, body = await self.request(
                "POST",
                "/collective_rpc",
                json={"method": method, "kwargs": kwargs | {"report_dir": str(reports)}},
            )
            if status != 200:
                raise VLLMUpstreamError(f"collective_rpc {method} answered {status}: {body!r:.300}")
            filed = [_read_report(p) for p in sorted(reports.glob("*.json"), key=_index)]
        finally:
            shutil.rmtree(reports, ignore_errors=True)
        results = body.get("results") if isinstance(body, dict) else None
        results = filed or results
        if not results or not all(isinstance(r, dict) for r in results):
            raise VLLMUpstreamError(f"collective_rpc {method}: no reports: {body!r:.300}")
        return list(results)


def _index(path: Path) -> int:
    return int(path.stem) if path.stem.isdigit() else -1


def _read_report(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {"error": f"unreadable report {path.name}: {exc}"}
