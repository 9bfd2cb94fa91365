"""The replica contract: what every inference backend serves over HTTP.

Token ids in; token ids, the sampled tokens' logprobs, a finish reason and the policy version
out. OpenAI's shape where OpenAI has a word for it, vLLM's names elsewhere:

    POST /v1/completions   CompletionRequest  -> CompletionResponse
    POST /abort_requests   {"request_ids": [...]}          abort those requests (finish "abort")
    POST /pause            ?mode=abort (default)           abort all in flight; new requests wait
    POST /resume                                           let waiting requests run
    GET  /is_paused        {"is_paused": bool}
    POST /update_weights   UpdateWeightsRequest            pause, load, set version, resume
    GET  /health           {"status": "ok", "version": int, "load": int, "capacity": int,
                           "role": "policy" | "judge"} (no role: it serves the policy; a judge
                           answers /update_weights with 409; the hf engine says its role in
                           /health and /info, other backends say none)
                           (503 with "awaiting_weights": true when started for broadcast
                           weights and not holding the trainer's yet: it serves nothing)
    GET  /info             ReplicaStatus
    GET  /metrics          Prometheus text (rollout_replica_* names, label replica)
    GET  /v1/models

A request that cannot be served (malformed JSON, unknown parameter, prompt past the context)
gets a 4xx with `{"error": {"message", "type"}}`; the server keeps serving.

Routed experts (Mixture-of-Experts models): a request with `return_routed_experts: true` gets
`choices[0].routed_experts`, a `schemas.routing.RoutedExperts` of every position the engine fed
from position 0, prompt and generated tokens (all but the last sampled token, which is never
fed), in MoE-layer order, packed u1 (≤ 256 experts) or <i2. A dense model answers such a
request with 400 (`invalid_request_error`) saying it routes nothing; a backend that cannot
return routing (a vLLM replica started without it) answers 400 likewise, never a silent None.
A request aborted before anything was fed has no routing to give (empty from `hf`, null from
vLLM); the client only reads routing of pieces that produced tokens. Without the flag nothing
is recorded and the field is null.

Images (vision-language models): `images` lists the prompt's images as `schemas.media.ImageRef`s
with their bytes inline (`data`); the prompt's token ids already hold each image's placeholder
tokens, expanded as the model's processor expands them (token-in/token-out stays the contract).
A text-only model answers a request with images with 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.media import ImageRef
from schemas.routing import RoutedExperts

__all__ = [
    "CAPACITY_HEADER",
    "LOAD_HEADER",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "FinishReason",
    "GenerateOutput",
    "ReplicaStatus",
    "SamplingParams",
    "UpdateWeightsRequest",
    "error_body",
]

FinishReason = Literal["stop", "length", "abort"]

LOAD_HEADER = "X-Rollout-Load"
"""Response header of every replica response: its running + waiting requests (an integer) when
the response was written, not counting the request answered. Also `load` in `/health` and
`rollout_replica_load` at `/metrics`."""

CAPACITY_HEADER = "X-Rollout-Capacity"
"""Response header of every replica response beside `LOAD_HEADER`: how many requests the replica
runs at once (an integer ≥ 1: the hf engine's batch limit, vLLM's `max_num_seqs` × its
data-parallel size); absent when the replica does not know. Also `capacity` in `/health` and
`rollout_replica_capacity` at `/metrics`. The balancer ranks by load / capacity."""


def error_body(
    status: int, message: str, err_type: str, *, server: str
) -> dict[str, dict[str, str]]:
    """The contract's error body of an answer `status` from the inference server `server`
    (an adapter's backend): its `message`, else "SERVER answered STATUS"; its `err_type`, else
    `invalid_request_error` for a 4xx and `internal_error` for anything else."""
    if not err_type:
        err_type = "invalid_request_error" if 400 <= status < 500 else "internal_error"
    return {"error": {"message": message or f"{server} answered {status}", "type": err_type}}


class SamplingParams(BaseModel):
    """Sampling parameters, with vLLM's names. Unknown names are an error, not ignored."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=256, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="-1 disables top-k.")
    seed: int | None = Field(default=None, description="Per-request RNG seed.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Finish 'stop' on these.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS.")
    logprobs: int | None = Field(
        default=1, ge=0, description="Return the sampled tokens' logprobs when not None."
    )


class CompletionRequest(SamplingParams):
    """`POST /v1/completions` body: a token-id prompt plus sampling parameters."""

    model: str | None = None
    prompt: list[int] = Field(min_length=1, description="Prompt token ids.")
    request_id: str | None = Field(default=None, description="Id for abort; sticky routing key.")
    return_token_ids: bool = True
    return_routed_experts: bool = Field(
        default=False, description="Return the routed experts of every position (MoE models)."
    )
    images: list[ImageRef] | None = Field(
        default=None, description="The prompt's images, bytes inline (module docstring)."
    )
    stream: Literal[False] = False

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(
            self.model_dump(include=set(SamplingParams.model_fields))
        )

    def server_sampling(self) -> dict[str, Any]:
        """This request's sampling as vLLM and SGLang both name it, every knob the contract
        does not carry at its neutral value: one sequence, special tokens kept in the text."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": False,
            "n": 1,
        }


class CompletionChoice(BaseModel):
    index: int = 0
    text: str = ""
    token_ids: list[int]
    logprobs: dict[str, list[float]] | None = Field(
        default=None, description="{'token_logprobs': [...]} of the sampled tokens."
    )
    finish_reason: FinishReason
    stop_reason: int | None = Field(default=None, description="The stop token id, if any.")
    routed_experts: RoutedExperts | None = Field(
        default=None, description="Experts of each position fed, when asked (module docstring)."
    )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: dict[str, int] = Field(default_factory=dict)
    policy_version: int = Field(ge=0, description="Version of the weights that produced it.")

    @classmethod
    def one(
        cls, choice: CompletionChoice, *, usage: dict[str, int], **response: Any
    ) -> CompletionResponse:
        """The contract's response: one sequence, `choice` (`response`: `id`, `created`,
        `model`, `policy_version`)."""
        return cls(choices=[choice], usage=usage, **response)


class UpdateWeightsRequest(BaseModel):
    """Load `path` (a checkpoint directory), or receive `transfer` (a grant of the trainer's,
    `workers.weights.protocol.Grant`, checked by the receiver): exactly one of the two."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(default="", description="Checkpoint directory (safetensors + config).")
    version: int = Field(ge=0, description="Policy version these weights are.")
    transfer: dict[str, Any] | None = Field(
        default=None, description="The trainer's grant: receive the weights over its group."
    )

    @model_validator(mode="after")
    def _one_source(self) -> UpdateWeightsRequest:
        if bool(self.path) == (self.transfer is not None):
            raise ValueError("give exactly one of path and transfer")
        return self


class ReplicaStatus(BaseModel):
    replica_id: str
    backend: str
    model: str
    version: int
    max_model_len: int
    is_paused: bool = False
    running: int = 0
    waiting: int = 0


class GenerateOutput(BaseModel):
    """What the client returns to an agent loop: one generation, however many pieces it took."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    min_global_steps: int
    max_global_steps: int
    pieces: int = Field(default=1, description="Requests it took (1 + resumes).")
    replicas: list[str] = Field(default_factory=list, description="Replica ids, in order.")
    routed_experts: RoutedExperts | None = Field(
        default=None,
        description="When asked: the routing of prompt + tokens from position 0, each position "
        "as the piece that first fed it recorded it (append-only across resumes).",
    )
