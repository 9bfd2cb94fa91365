"""One request inside the `hf` engine: its tokens so far, its finish rules, its delivery.

An `EngineSequence` is created on the caller's event loop and then touched only by the engine thread
until it is delivered; `deliver` hands the result (or an error) back to the caller's loop
thread-safely and does nothing if the caller has gone (its future was cancelled or its loop
closed).

Finish rules, checked after every sampled token (which is kept in `out`, logprob included):
a token in `stop_token_ids` → "stop" with `stop_reason` = that id; an eos token (unless
`ignore_eos`) → "stop" with `stop_reason` None, as vLLM reports it; `max_tokens` reached or the
context full → "length". "abort" is set from outside.

Routed experts (a MoE model's, when the request asked): `routing` holds the rows `RouterTap`
took, in position order, from position 0: the cached prefix's, the prefill's, then one per
decode step. The last sampled token is never fed, so a result's routing covers
`len(prompt) + len(out) - 1` positions, exactly the tokens its KV covers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from workers.llm.contract import FinishReason, SamplingParams

__all__ = ["EngineSequence", "GenerationResult"]


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: int | None
    policy_version: int
    prompt_tokens: int
    cached_tokens: int
    routed_experts: np.ndarray | None = None  # (positions, layers, top_k); None: not asked


@dataclass(eq=False)
class EngineSequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    generator: torch.Generator
    order: int = 0
    version: int = 0
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    finish: FinishReason | None = None
    stop_reason: int | None = None
    routing: list[np.ndarray] | None = None  # chunks of (positions, layers, top_k); None: not asked
    # The prefix-cache key of the prompt: the prompt, each image's tokens named by its hash
    # (`images.Prepared.key`); and the prompt's images (None: a text prompt).
    key: list[int] = field(default_factory=list)
    images: Any = None

    def routed(self) -> np.ndarray | None:
        """The routing so far as one (positions, layers, top_k) array (None: not asked)."""
        if self.routing is None:
            return None
        if len(self.routing) > 1:
            self.routing = [np.concatenate(self.routing)]
        return self.routing[0] if self.routing else None

    def append(self, token: int, logprob: float, eos: Set[int], max_model_len: int) -> None:
        """Record one sampled token and apply the finish rules."""
        self.out.append(token)
        self.logprobs.append(logprob)
        p = self.params
        if token in p.stop_token_ids:
            self.finish, self.stop_reason = "stop", token
        elif token in eos and not p.ignore_eos:
            self.finish = "stop"
        elif len(self.out) >= p.max_tokens or len(self.prompt) + len(self.out) >= max_model_len:
            self.finish = "length"

    def result(self) -> GenerationResult:
        assert self.finish is not None
        return GenerationResult(
            request_id=self.request_id,
            token_ids=self.out,
            logprobs=self.logprobs,
            finish_reason=self.finish,
            stop_reason=self.stop_reason,
            policy_version=self.version,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            routed_experts=self.routed(),
        )

    def deliver(self, outcome: GenerationResult | BaseException | None = None) -> None:
        """Hand the result (default: `result()`) or an error to the caller's event loop."""
        value = self.result() if outcome is None else outcome
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, value)
        except RuntimeError:  # the caller's event loop is closed; nobody is waiting
            pass


def _settle(fut: asyncio.Future[GenerationResult], value: GenerationResult | BaseException) -> None:
    if fut.done():  # the caller went away (cancelled)
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
