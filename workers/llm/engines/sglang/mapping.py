"""Pure mappings between the replica contract and SGLang's native HTTP API.

No I/O and no `sglang` import: every function takes and returns plain data, so the `sglang`
backend's translation is unit-tested on a machine where SGLang cannot run. The shapes were
read from SGLang 0.5.23's source (python/sglang/srt/...), not recorded from a running server:
SGLang has not run under this adapter yet (README "SGLang"; infra/gpu_check.sh runs it).

- `POST /generate` (entrypoints/http_server.py, managers/io_struct.py `GenerateReqInput`):
  `{"rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
  "top_logprobs_num", "stream"}`. The answer is `{"text", "output_ids", "meta_info"}` with
  `meta_info.finish_reason` one of `{"type": "length", "length": n}`, `{"type": "stop",
  "matched": token id | str}` (an EOS or stop token, or a stop string) and
  `{"type": "abort", "message", "status_code", "err_type"}` (managers/schedule_batch.py
  `FINISH_*`). An abort by `/abort_request` keeps the tokens generated so far and comes back as
  200; an abort that carries a 4xx/5xx `status_code` is an error answer instead.
  `meta_info.output_token_logprobs` is `[[logprob, token_id, text | null], ...]`, one per
  output token (`detokenize_logprob_tokens`); `meta_info.weight_version` is the label the
  weights were loaded with. `text` is absent under `--skip-tokenizer-init`.
- Sampling (sampling/sampling_params.py): `max_new_tokens`, `temperature`, `top_p`, `top_k`
  (-1: all), `min_p`, the three penalties, `stop_token_ids`, `ignore_eos`,
  `skip_special_tokens`, `sampling_seed` (honoured only under
  `--enable-deterministic-inference`). Neutral penalties are sent explicitly, as for vLLM.
  Logprobs are those of the temperature-scaled distribution before top-k/top-p truncation
  (layers/sampler.py): the same as vLLM's `processed_logprobs` unless top-k or top-p cut.
- `/abort_request {"rid" | "abort_all"}` aborts every request whose rid *starts with* the given
  one (managers/scheduler.py `abort_request`): rids are therefore made prefix-free here
  (`upstream_rid`: a 32-hex uuid first).
- Errors: `{"error": {"message"}}`, `{"error": "text"}` or FastAPI's `{"detail": ...}`.
- `/metrics` (observability/metrics_collector.py, with `--enable-metrics`): gauges
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`; counters `sglang:generation_tokens`,
  `sglang:prompt_tokens` (prefix-cache queries, in tokens) and `sglang:cached_tokens` (hits, in
  tokens, one series per cache source), each summed over its labels here.
- `GET /server_info`: `internal_states`, one per data-parallel rank, each with
  `effective_max_running_requests_per_dp` (managers/scheduler_components/internal_state.py).
- Weights: `/update_weights_from_disk {"model_path", "weight_version", "flush_cache"}` →
  `{"success", "message", "num_paused_requests"}` (400 when not successful). SGLang's own
  distributed update, not used by this adapter: `/init_weights_update_group {master_address,
  master_port, rank_offset, world_size, group_name, backend}` joins the server's workers to a
  trainer's NCCL group, then each `/update_weights_from_distributed {names, dtypes, shapes,
  group_name, flush_cache, weight_version}` receives those tensors broadcast from the
  trainer's rank 0; `/destroy_weights_update_group` leaves.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from typing import Any

from workers.llm.contract import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FinishReason,
    error_body,
)
from workers.llm.engines.exceptions import UpstreamError
from workers.metrics import ReplicaCounters, prometheus_totals

__all__ = [
    "SGLangUpstreamError",
    "capacity_from_server_info",
    "from_sglang_generate",
    "map_sglang_error",
    "parse_sglang_metrics",
    "to_sglang_generate",
    "update_from_disk_body",
    "upstream_rid",
]

_LOGPROB_FLOOR = -9999.0  # as the vllm backend: a missing or -inf logprob is clamped to this
_FINISH_TYPES: frozenset[str] = frozenset({"stop", "length", "abort"})

# contract field -> SGLang family names (prometheus_client strips `_total` from counters)
_SGLANG_FAMILIES: dict[str, str] = {
    "running": "sglang:num_running_reqs",
    "waiting": "sglang:num_queue_reqs",
    "generated_tokens": "sglang:generation_tokens",
    "prefix_cache_queries": "sglang:prompt_tokens",
    "prefix_cache_hits": "sglang:cached_tokens",
}


class SGLangUpstreamError(UpstreamError):
    """SGLang failed a call, or answered outside what this backend relies on (→ HTTP 5xx)."""


def upstream_rid(request_id: str | None) -> str:
    """A rid no other rid starts with (SGLang aborts by prefix): a fresh uuid, then the
    caller's id for the logs."""
    return f"{uuid.uuid4().hex}-{request_id or 'req'}"


def to_sglang_generate(req: CompletionRequest, *, rid: str) -> dict[str, Any]:
    """The `/generate` body for one contract request (never streamed, one sequence)."""
    sampling: dict[str, Any] = {"max_new_tokens": req.max_tokens, **req.server_sampling()}
    if req.seed is not None:
        sampling["sampling_seed"] = req.seed
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(req.prompt),
        "sampling_params": sampling,
        "stream": False,
    }
    if req.logprobs is not None:
        # The contract returns the sampled tokens' logprobs only: no prompt, no top-k.
        body |= {"return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0}
    return body


def _finish(meta: Mapping[str, Any], stop_token_ids: list[int]) -> tuple[FinishReason, int | None]:
    """(finish reason, stop token id) from `meta_info.finish_reason`. The stop token id is
    reported only for a token the request named: SGLang says `matched` for EOS too, where the
    vllm backend (and so the contract) says null."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    if kind not in _FINISH_TYPES:
        raise SGLangUpstreamError(f"SGLang finish_reason {reason!r} is not one the contract has")
    matched = reason.get("matched") if isinstance(reason, Mapping) else None
    stop = matched if type(matched) is int and matched in stop_token_ids else None
    return kind, stop  # type: ignore[return-value]


def _logprobs(meta: Mapping[str, Any], token_ids: list[int]) -> list[float]:
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        raise SGLangUpstreamError(
            f"SGLang logprobs do not match the tokens ({len(token_ids)} tokens, "
            f"output_token_logprobs={entries!r:.80})"
        )
    out: list[float] = []
    for entry, token in zip(entries, token_ids, strict=True):
        if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[1] != token:
            raise SGLangUpstreamError(
                f"SGLang logprob entry {entry!r:.80} is not for token {token}"
            )
        value = entry[0]
        ok = isinstance(value, int | float) and math.isfinite(value)
        out.append(float(value) if ok else _LOGPROB_FLOOR)
    return out


def from_sglang_generate(
    body: Mapping[str, Any],
    *,
    policy_version: int,
    want_logprobs: bool,
    request_id: str,
    model: str,
    created: int,
    stop_token_ids: list[int],
) -> CompletionResponse:
    """Map a `/generate` answer to the contract, stamping `policy_version`."""
    meta = body.get("meta_info")
    ids = body.get("output_ids")
    if not isinstance(meta, Mapping) or not isinstance(ids, list):
        raise SGLangUpstreamError(f"SGLang answer has no output_ids/meta_info: {body!r:.200}")
    token_ids = [int(t) for t in ids]
    finish, stop = _finish(meta, stop_token_ids)
    logprobs = {"token_logprobs": _logprobs(meta, token_ids)} if want_logprobs else None
    prompt_tokens = meta.get("prompt_tokens")
    usage = {"completion_tokens": len(token_ids)}
    if type(prompt_tokens) is int:
        usage |= {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(token_ids)}
    choice = CompletionChoice(
        text=str(body.get("text") or ""),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish,
        stop_reason=stop,
    )
    return CompletionResponse.one(
        choice, usage=usage, id=request_id, created=created, model=model,
        policy_version=policy_version,
    )  # fmt: skip


def map_sglang_error(status: int, body: Any) -> dict[str, dict[str, str]]:
    """SGLang's error body (any of its shapes) in the contract's `{"error": {message, type}}`."""
    message, err_type = "", ""
    if isinstance(body, Mapping):
        inner = body.get("error", body.get("detail"))
        if isinstance(inner, Mapping):
            message = str(inner.get("message") or "")
            err_type = str(inner.get("type") or "")
        elif inner is not None:
            message = str(inner)
        else:
            message = str(body.get("message") or "")
    elif body:
        message = str(body)
    return error_body(status, message, err_type, server="SGLang")


def update_from_disk_body(path: str, version: int) -> dict[str, Any]:
    """`/update_weights_from_disk`: load `path`, label it `version`, drop the prefix cache (KV
    computed by the old weights must never be reused by the new ones)."""
    return {"model_path": path, "weight_version": str(version), "flush_cache": True}


def parse_sglang_metrics(text: str) -> ReplicaCounters:
    """Sum SGLang's Prometheus text into the contract's counters; an absent series reads 0."""
    totals = prometheus_totals(text)
    return ReplicaCounters(**{f: totals.get(n, 0.0) for f, n in _SGLANG_FAMILIES.items()})


def capacity_from_server_info(info: Any) -> int | None:
    """Requests the server runs at once: each data-parallel rank's
    `effective_max_running_requests_per_dp`, summed; None when the body does not say."""
    states = info.get("internal_states") if isinstance(info, Mapping) else None
    if not isinstance(states, list) or not states:
        return None
    per_rank = [
        s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, Mapping)
    ]
    if len(per_rank) != len(states) or not all(type(n) is int and n >= 1 for n in per_rank):
        return None
    return sum(per_rank)  # type: ignore[arg-type]
