"""A thin async client of one SGLang server (the `sglang` adapter's upstream).

Endpoints used (SGLang 0.5.23's http_server.py; none needs a special mode): `/health`,
`/v1/models` (`max_model_len`), `/server_info` (read once, for the capacity), `/metrics`
(with `--enable-metrics`), `/generate`, `/abort_request`, `/pause_generation`,
`/continue_generation`, `/update_weights_from_disk`. The shapes and what each means are in
`workers.llm.engines.sglang.mapping`.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from workers.llm.engines.sglang.mapping import SGLangUpstreamError
from workers.llm.engines.upstream import CONTROL_TIMEOUT, UPSTREAM_ERRORS, Upstream

__all__ = ["UPSTREAM_ERRORS", "SGLangUpstream"]


class SGLangUpstream(Upstream):
    """HTTP calls to SGLang at `base_url`; open with `start()`, close with `close()`."""

    engine = "SGLang"
    error = SGLangUpstreamError
    _metrics_hint = " (--enable-metrics?)"

    async def control(
        self, path: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout = CONTROL_TIMEOUT
    ) -> Any:
        """POST a control endpoint; SGLangUpstreamError unless it answers 200 (and, where the
        body has one, `success: true`)."""
        status, answer = await self.request("POST", path, json=body, timeout=timeout)
        failed = isinstance(answer, dict) and answer.get("success") is False
        if status != 200 or failed:
            message = answer.get("message") if isinstance(answer, dict) else answer
            raise SGLangUpstreamError(f"SGLang {path} answered {status}: {message!r:.300}")
        return answer
