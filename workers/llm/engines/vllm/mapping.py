"""Pure mappings between the replica contract and vLLM's OpenAI-compatible server.

No I/O and no `vllm` import: every function here takes and returns plain data, so the
`vllm` backend's translation is unit-tested on a machine without vLLM or a GPU.

What vLLM does, and where it was read (vLLM main, 2025-2026):
- `POST /v1/completions` (vllm/entrypoints/openai/completion/protocol.py, serving.py):
  `prompt` may be `list[int]`; `return_token_ids` adds `choices[].token_ids` (and
  `prompt_token_ids`); `logprobs: 0` returns the sampled token's logprob only, as
  `choices[].logprobs.token_logprobs` (clamped to -9999.0); `return_tokens_as_token_ids`
  spells `logprobs.tokens` as `"token_id:<id>"`, which needs no tokenizer.
  The engine request id is `f"cmpl-{request_id}-{i}"` (i = prompt index, always 0 here).
- `finish_reason` is `"stop" | "length" | "abort"` (v1 `FinishReason.__str__`); an aborted
  request's final output keeps the tokens generated so far (v1 `OutputProcessor.abort_requests`
  emits a last output with `FinishReason.ABORT`). `stop_reason` is the stop token id (int),
  a stop string, or null for EOS / length.
- Errors: `{"error": {"message", "type", "code"}}` (recent) or
  `{"object": "error", "message", "type", "code"}` (older).
- `/metrics` (vllm/v1/metrics/loggers.py): gauges `vllm:num_requests_running`,
  `vllm:num_requests_waiting`; counters `vllm:generation_tokens`, `vllm:prefix_cache_queries`,
  `vllm:prefix_cache_hits` (exposed with `_total`; older releases named the cache counters
  `vllm:gpu_prefix_cache_*`), one series per engine (label `engine`), summed here.
- Routed experts (vllm/entrypoints/openai/completion/protocol.py, serving.py; server flag
  `--enable-return-routed-experts`, model runner V2 only): `choices[].routed_experts` is the
  base64 of a `.npy` file (`numpy2base64`: `np.save(..., allow_pickle=False)`) holding
  (prompt + output tokens − 1, MoE layers, top_k) expert ids, uint8/uint16/int32; the last
  sampled token was never fed. Null when the request was aborted before any forward pass or the
  server flag is off. Every request gets it once the flag is on (there is no per-request switch
  but `routed_experts_prompt_start`, left at 0 here: positions from 0, as the contract has them).
- `POST /inference/v1/generate` (`GENERATE_PATH`): vLLM's multimodal processor applies its
  prompt updates to the token ids it is given, always: a LLaVA `<image>` token is replaced by
  the image's feature count of copies, so ids that already hold the expanded run get it expanded
  again (4 copies become 4 image features + 3 text `<image>` embeddings, positions shifted; the
  logprobs then differ from the trainer's by up to 0.1). `to_vllm_generate` sends one
  placeholder per image (`collapse_image_placeholders`).
- `GET /server_info?config_format=json` (dev mode, vllm/entrypoints/serve/dev/server_info):
  `{"vllm_config": {...}}`, the resolved config, where `scheduler_config.max_num_seqs` is what
  one data-parallel rank runs at once (its default depends on the platform: 128 on CPU) and
  `parallel_config.data_parallel_size` the ranks behind the one address.

Sampling parameters the contract does not carry (`repetition_penalty`, `min_p`, penalties) are
sent explicitly as neutral values, so a model's `generation_config.json` defaults can never
change the sampling distribution behind the trainer's back.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from schemas.routing import RoutedExperts
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
    "FINISH_REASONS",
    "GENERATE_PATH",
    "VLLMMetrics",
    "VLLMUpstreamError",
    "capacity_from_server_info",
    "collapse_image_placeholders",
    "engine_request_id",
    "from_vllm_completion",
    "generate_as_completion",
    "generate_engine_id",
    "map_vllm_error",
    "parse_vllm_metrics",
    "routed_experts_from_vllm",
    "to_vllm_completion",
    "to_vllm_generate",
]

logger = logging.getLogger("rollout.replica.vllm")

FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})
_TOKEN_ID_PREFIX = "token_id:"
_LOGPROB_FLOOR = -9999.0  # vLLM's own clamp for -inf


class VLLMUpstreamError(UpstreamError):
    """vLLM failed a call, or answered outside what this backend relies on (→ HTTP 5xx)."""


def engine_request_id(upstream_id: str) -> str:
    """The id vLLM's engine gives a one-prompt completion sent with `request_id=upstream_id`.

    `/abort_requests` takes these ids (serving.py: `f"cmpl-{base}"`, then `f"{id}-{i}"`).
    """
    return f"cmpl-{upstream_id}-0"


def to_vllm_completion(req: CompletionRequest, *, model: str, upstream_id: str) -> dict[str, Any]:
    """The `/v1/completions` body for one contract request (never streamed, one choice)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        **req.server_sampling(),
        "stream": False,
        "echo": False,
        "request_id": upstream_id,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if req.seed is not None:
        body["seed"] = req.seed
    if req.logprobs is not None:
        # The contract only ever returns the sampled tokens' logprobs: 0 asks for exactly that.
        body["logprobs"] = 0
    return body


#: The scale-out token-in/token-out endpoint (`vllm serve --enable-scale-out`): the one vLLM 0.32
#: route that takes token ids *and* images; `/v1/completions` takes no images with token ids.
GENERATE_PATH = "/inference/v1/generate"


def generate_engine_id(upstream_id: str) -> str:
    """The id vLLM's engine gives a `GENERATE_PATH` request (what `/abort_requests` takes)."""
    return f"generate-tokens-{upstream_id}"


def collapse_image_placeholders(prompt: list[int], image_token_id: int, images: int) -> list[int]:
    """`prompt` with each image's run of `image_token_id` copies (the contract's expanded form)
    cut to the one placeholder vLLM expands itself (module doc). Every image has the same count
    (LLaVA's fixed feature count): placeholders ÷ images. ValueError when that does not divide
    or a run is no whole number of images."""
    total = sum(1 for t in prompt if t == image_token_id)
    if images < 1 or total == 0 or total % images:
        raise ValueError(
            f"images: {images} image(s) but {total} image placeholder token(s) "
            f"(id {image_token_id}) in the prompt, not the same count for each"
        )
    per_image = total // images
    out: list[int] = []
    run = 0
    for token in [*prompt, None]:
        if token == image_token_id:
            run += 1
            continue
        if run:
            if run % per_image:
                raise ValueError(
                    f"images: a run of {run} image placeholder tokens is no whole number of "
                    f"images of {per_image} tokens each"
                )
            out.extend([image_token_id] * (run // per_image))
            run = 0
        if token is not None:
            out.append(token)
    return out


def to_vllm_generate(
    req: CompletionRequest, *, model: str, upstream_id: str, image_token_id: int | None = None
) -> dict[str, Any]:
    """The `GENERATE_PATH` body for a request with images: the prompt's token ids, each image's
    expanded placeholder run cut back to one `image_token_id` (vLLM expands it again; module
    doc) when that id is given, and the images as content parts, `data:` URIs named by their
    SHA-256 (vLLM's multimodal cache keys on that name). ValueError on placeholders that do not
    match the images (`collapse_image_placeholders`)."""
    completion = to_vllm_completion(req, model=model, upstream_id=upstream_id)
    params = {
        key: completion[key]
        for key in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
                    "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "stop_token_ids", "ignore_eos", "skip_special_tokens", "logprobs")
        if key in completion
    }  # fmt: skip
    parts = []
    for image in req.images or []:
        if image.data is None:
            raise ValueError(f"image {image.sha256[:12]}: no bytes inline (the contract's rule)")
        url = f"data:{image.mime_type};base64,{image.data}"
        parts.append({"type": "image_url", "url": url, "uuid": image.sha256})
    prompt = list(req.prompt)
    if image_token_id is not None:
        prompt = collapse_image_placeholders(prompt, image_token_id, len(parts))
    return {
        "request_id": upstream_id,
        "model": model,
        "token_ids": prompt,
        "sampling_params": params,
        "output_mode": "tokens",
        "content_parts": parts,
    }


def generate_as_completion(body: Any) -> dict[str, Any]:
    """A `GENERATE_PATH` answer in `/v1/completions`' shape (`from_vllm_completion` maps it):
    its logprobs are `{"content": [{"token_id", "logprob"}, ...]}`, one per generated token."""
    if not isinstance(body, Mapping) or not isinstance(body.get("choices"), list):
        raise VLLMUpstreamError(f"vLLM {GENERATE_PATH} answered without choices: {body!r:.200}")
    choices = []
    for choice in body["choices"]:
        choice = dict(choice)
        content = (choice.get("logprobs") or {}).get("content")
        if content is not None:
            choice["logprobs"] = {"token_logprobs": [c.get("logprob") for c in content]}
        choices.append(choice)
    return {**body, "id": body.get("request_id", ""), "choices": choices}


def _token_ids(choice: Mapping[str, Any]) -> list[int]:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(t) for t in ids]
    # Before `return_token_ids` existed: recover ids from "token_id:<id>" logprob tokens.
    lp = choice.get("logprobs")
    tokens = lp.get("tokens") if isinstance(lp, Mapping) else None
    if isinstance(tokens, list) and all(
        isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) for t in tokens
    ):
        return [int(t[len(_TOKEN_ID_PREFIX) :]) for t in tokens]
    raise VLLMUpstreamError("vLLM response has no token_ids (needs return_token_ids)")


def _token_logprobs(choice: Mapping[str, Any], n_tokens: int) -> list[float] | None:
    lp = choice.get("logprobs")
    if lp is None:
        return None
    values = lp.get("token_logprobs") if isinstance(lp, Mapping) else None
    if not isinstance(values, list) or len(values) != n_tokens:
        raise VLLMUpstreamError(
            f"vLLM logprobs do not match the tokens ({n_tokens} tokens, logprobs={values!r:.80})"
        )
    out: list[float] = []
    for v in values:
        if v is None or not math.isfinite(float(v)):
            logger.warning("vLLM returned a missing logprob; using the floor %s", _LOGPROB_FLOOR)
            out.append(_LOGPROB_FLOOR)
        else:
            out.append(float(v))
    return out


def routed_experts_from_vllm(value: Any, num_experts: int) -> RoutedExperts:
    """vLLM's `routed_experts` (base64 of a `.npy`, see the module docstring) as the contract's.

    Read with `allow_pickle=False`: an object array is an error, never unpickled."""
    if not isinstance(value, str):
        raise VLLMUpstreamError(f"vLLM routed_experts is {type(value).__name__}, not base64 text")
    try:
        array = np.lib.format.read_array(
            io.BytesIO(pybase64.b64decode(value, validate=True)), allow_pickle=False
        )
    except ValueError as exc:  # bad base64, not a .npy, or an object array
        raise VLLMUpstreamError(f"vLLM routed_experts is not a .npy array: {exc}") from exc
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise VLLMUpstreamError(
            f"vLLM routed_experts has shape {array.shape} of {array.dtype}, "
            "not (tokens, layers, top_k) integers"
        )
    try:
        return RoutedExperts.from_array(array, num_experts)
    except ValueError as exc:  # pydantic's ValidationError too: an expert id past num_experts
        raise VLLMUpstreamError(f"vLLM routed_experts do not fit the model: {exc}") from exc


def _finish_reason(value: Any) -> FinishReason:
    if value in FINISH_REASONS:
        return value  # type: ignore[no-any-return]
    raise VLLMUpstreamError(f"vLLM finish_reason {value!r} is not one of {sorted(FINISH_REASONS)}")


def from_vllm_completion(
    body: Mapping[str, Any],
    *,
    policy_version: int,
    want_logprobs: bool,
    request_id: str | None = None,
    num_experts: int | None = None,
) -> CompletionResponse:
    """Map a `/v1/completions` response to the contract, stamping `policy_version`.

    `num_experts` (a MoE model whose routing was asked for): map `routed_experts` too; a
    response without it is one of a request aborted before any forward pass, and gets none."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise VLLMUpstreamError(f"vLLM returned {len(choices or [])} choices, expected 1")
    choice = choices[0]
    token_ids = _token_ids(choice)
    logprobs = _token_logprobs(choice, len(token_ids)) if want_logprobs else None
    if want_logprobs and logprobs is None:
        raise VLLMUpstreamError("vLLM response has no logprobs although they were requested")
    stop_reason = choice.get("stop_reason")
    usage = body.get("usage") or {}
    routed = choice.get("routed_experts")
    if num_experts is not None and routed is None and token_ids:
        raise VLLMUpstreamError("vLLM returned no routed_experts (needs its server flag)")
    routing = (
        routed_experts_from_vllm(routed, num_experts)
        if num_experts is not None and routed is not None
        else None
    )
    one = CompletionChoice(
        text=str(choice.get("text") or ""),
        token_ids=token_ids,
        logprobs=None if logprobs is None else {"token_logprobs": logprobs},
        finish_reason=_finish_reason(choice.get("finish_reason")),
        # A stop *string* has no token id; the contract only reports stop tokens.
        stop_reason=stop_reason if type(stop_reason) is int else None,
        routed_experts=routing,
    )
    return CompletionResponse.one(
        one,
        usage={k: v for k, v in usage.items() if type(v) is int},
        id=request_id or str(body.get("id", "")),
        created=int(body.get("created", 0)),
        model=str(body.get("model", "")),
        policy_version=policy_version,
    )


def map_vllm_error(status: int, body: Any) -> dict[str, dict[str, str]]:
    """vLLM's error body (either generation) in the contract's `{"error": {message, type}}`."""
    message, err_type = "", ""
    if isinstance(body, Mapping):
        inner = body.get("error") if isinstance(body.get("error"), Mapping) else body
        message = str(inner.get("message") or inner.get("detail") or "")
        err_type = str(inner.get("type") or "")
    elif body:
        message = str(body)
    return error_body(status, message, err_type, server="vLLM")


@dataclass(frozen=True)
class VLLMMetrics(ReplicaCounters):
    """The vLLM series the contract re-exposes, summed over engines (DP ranks)."""


# contract field -> vLLM family names, preferred first (prometheus_client strips `_total`).
_VLLM_FAMILIES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "generated_tokens": ("vllm:generation_tokens",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}


def parse_vllm_metrics(text: str) -> VLLMMetrics:
    """Sum vLLM's Prometheus text into `VLLMMetrics`; a series that is absent reads 0."""
    totals = prometheus_totals(text)
    fields: dict[str, float] = {}
    for field, names in _VLLM_FAMILIES.items():
        fields[field] = next((totals[n] for n in names if n in totals), 0.0)
    return VLLMMetrics(**fields)


def capacity_from_server_info(info: Any) -> int | None:
    """Requests the server runs at once (`max_num_seqs` × data-parallel ranks), from its
    `/server_info` body; None when the body does not say."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        return None
    scheduler, parallel = config.get("scheduler_config"), config.get("parallel_config")
    seqs = scheduler.get("max_num_seqs") if isinstance(scheduler, dict) else None
    ranks = parallel.get("data_parallel_size", 1) if isinstance(parallel, dict) else 1
    if not (isinstance(seqs, int) and isinstance(ranks, int)) or seqs < 1 or ranks < 1:
        return None
    return seqs * ranks
