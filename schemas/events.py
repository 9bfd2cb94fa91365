"""The events that travel on the pipeline's topics, one pydantic model each.

Every event carries `schema_version` and a `kind` tag; `Event` is the discriminated union of
all of them and the codec decodes through it in one pass. Field names follow verl
(`prompt_ids`, `response_ids`, `response_mask`, `response_logprobs`, `num_turns`,
`reward_score`, `extra_fields` with `min_global_steps`/`max_global_steps`) so that code
written against verl's `AgentLoopOutput` reads these unchanged.

Invariants the models enforce:
- a turn's, trajectory's or group's `min_global_steps <= max_global_steps`;
- per-token arrays of one trajectory have equal lengths (`response_ids`, `response_mask`,
  `response_logprobs`), and a turn's logprobs (when present) match its tokens;
- `trajectory_id == f"{uid}/{sample_index}"`;
- a trajectory's `routed_experts` (Mixture-of-Experts policies, `schemas.routing`) covers at
  most its prompt + response positions.

`routed_experts` is None for dense models (and when not asked for), and then absent on the
wire: such an event encodes exactly as before the field existed, so older readers (whose models
forbid unknown fields) read it unchanged. On a `TurnEvent` it is the routing the turn's
generation returned, from position 0 of the trajectory (prompt, earlier turns, this turn's
tokens but its last); the reward stage folds the turns' routing in order, append-only
(`RoutedExperts.extended_by`), into the trajectory's.

`images` (turn 0 and `ScoredTrajectory`) is the prompt's image references (`schemas.media`),
None and likewise absent on the wire for a text prompt. A prompt's message contents may be
lists of text and image parts; past `rollout produce` its images are `image_ref` parts.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from schemas.arrays import FloatArray, IntArray, MaskArray, arrays_equal
from schemas.media import ContentPart, ImageRef, content_parts
from schemas.routing import RoutedExperts

SCHEMA_VERSION = 1

__all__ = [
    "POLICY_KEY",
    "SCHEMA_VERSION",
    "ChatMessage",
    "Event",
    "EventBase",
    "ExtraFields",
    "PolicyVersion",
    "PromptEvent",
    "ReplicaInfo",
    "ReplicaRole",
    "RewardModelSpec",
    "ScoredTrajectory",
    "TrainingGroup",
    "TurnEvent",
    "WeightTransfer",
    "trajectory_id",
]


def trajectory_id(uid: str, sample_index: int) -> str:
    """The deterministic id of one sample of one prompt."""
    return f"{uid}/{sample_index}"


def _now() -> float:
    return time.time()


class EventBase(BaseModel):
    """Fields shared by every event: the schema version and when the event was made."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=False)

    schema_version: Literal[1] = Field(
        default=SCHEMA_VERSION, description="Version of the wire schema; bumped on breaking change."
    )
    created_at: float = Field(default_factory=_now, description="Unix time the event was made.")

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        assert isinstance(other, BaseModel)
        return all(
            arrays_equal(getattr(self, name), getattr(other, name))
            for name in type(self).model_fields
        )

    __hash__ = None  # type: ignore[assignment]


class ChatMessage(BaseModel):
    """One chat message of a prompt, in the OpenAI/verl shape: `content` is a string or a
    list of text and image parts (`schemas.media`)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart]
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return content_parts(value)  # one clear message, not one per member of the union


class RewardModelSpec(BaseModel):
    """verl's `reward_model` column: how to score, and the reference answer."""

    model_config = ConfigDict(extra="allow")

    style: str = Field(default="rule", description="'rule' or 'model'.")
    ground_truth: JsonValue = Field(
        default=None,
        description="Reference answer, if any, of any JSON type as verl's datasets write it: "
        "a string, a number, a list, or a dict such as Search-R1's {'target': [...]}.",
    )


class ExtraFields(BaseModel):
    """verl's `extra_fields`: the policy versions a trajectory spanned, and free extras."""

    model_config = ConfigDict(extra="allow")

    min_global_steps: int = Field(ge=0, description="Oldest policy version that produced a token.")
    max_global_steps: int = Field(ge=0, description="Newest policy version that produced a token.")

    @model_validator(mode="after")
    def _ordered(self) -> ExtraFields:
        if self.min_global_steps > self.max_global_steps:
            raise ValueError("min_global_steps must not exceed max_global_steps")
        return self


_NOT_CONTENT = {"kind", "schema_version", "created_at", "uid"}


def _without_none_routing(data: Any) -> Any:
    """A dumped event without `routed_experts` (or `images`) when it is None (module
    docstring)."""
    for name in ("routed_experts", "images"):
        if isinstance(data, dict) and name in data and data[name] is None:
            del data[name]
    return data


class PromptEvent(EventBase):
    """A prompt to roll out `n` times (topic `rl.prompts`, key `uid`)."""

    kind: Literal["prompt"] = "prompt"
    uid: str = Field(min_length=1, description="Identity of the prompt; key on the topic.")
    prompt: list[ChatMessage] = Field(min_length=1, description="Chat messages to complete.")
    data_source: str = Field(min_length=1, description="Selects the rule-based scorer.")
    reward_model: RewardModelSpec = Field(default_factory=RewardModelSpec)
    extra_info: dict[str, Any] = Field(default_factory=dict)
    ability: str | None = None
    agent_name: str | None = Field(default=None, description="Agent loop to run; else default.")
    n: int | None = Field(default=None, ge=1, le=1024, description="Samples; else configured n.")

    def content_digest(self) -> str:
        """16 hex digits of BLAKE2b over what the prompt asks (everything but its uid and
        stamps): equal for a re-delivery of the same prompt, different for another prompt
        produced under the same uid, which the downstream stages then dead-letter as
        `duplicate_uid` instead of silently merging or dropping it."""
        content = self.model_dump(
            mode="json", exclude={"kind", "schema_version", "created_at", "uid"}
        )
        return hashlib.blake2b(
            orjson.dumps(content, option=orjson.OPT_SORT_KEYS), digest_size=8
        ).hexdigest()


class TurnEvent(EventBase):
    """One turn of one trajectory (topic `rl.turns`, key `trajectory_id`).

    Assistant turns carry the sampled tokens with their logprobs (`loss_mask=1`); tool and
    user turns carry the injected tokens (`loss_mask=0`). Turn 0 carries the prompt and what
    the reward stage needs; the last turn has `final=True` and the trajectory's totals.
    """

    kind: Literal["turn"] = "turn"
    trajectory_id: str
    uid: str = Field(min_length=1)
    sample_index: int = Field(ge=0)
    attempt_id: str = Field(min_length=1, description="One run of this trajectory.")
    turn_index: int = Field(ge=0)
    role: Literal["assistant", "tool", "user"]
    token_ids: IntArray
    logprobs: FloatArray | None = None
    min_global_steps: int = Field(ge=0)
    max_global_steps: int = Field(ge=0)
    stop_reason: str | None = Field(default=None, description="stop, length, abort, tool_calls…")
    final: bool = False
    # Turn 0 only: the prompt and what scoring needs.
    prompt_ids: IntArray | None = None
    data_source: str | None = None
    reward_model: RewardModelSpec | None = None
    extra_info: dict[str, Any] | None = None
    agent_name: str | None = None
    group_size: int | None = Field(default=None, ge=1, description="Samples of this prompt (n).")
    prompt_digest: str | None = Field(
        default=None, description="`PromptEvent.content_digest()` of the prompt (turn 0 only)."
    )
    # Tool turns: what the tools returned besides tokens.
    tool_reward: float | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    routed_experts: RoutedExperts | None = Field(
        default=None,
        description="MoE policies, assistant turns: the routing the generation returned, from "
        "position 0 of the trajectory (module docstring).",
    )
    images: list[ImageRef] | None = Field(
        default=None,
        description="Turn 0 of a prompt with images: their references, in prompt order "
        "(`schemas.media`); None (off the wire) for a text prompt.",
    )
    # Final turn only: totals over the trajectory.
    num_turns: int | None = Field(default=None, ge=1)
    response_length: int | None = Field(default=None, ge=0)
    extra_fields: ExtraFields | None = None

    @property
    def loss_mask(self) -> int:
        return 1 if self.role == "assistant" else 0

    @model_validator(mode="after")
    def _consistent(self) -> TurnEvent:
        if self.trajectory_id != trajectory_id(self.uid, self.sample_index):
            raise ValueError("trajectory_id must be '{uid}/{sample_index}'")
        if self.min_global_steps > self.max_global_steps:
            raise ValueError("min_global_steps must not exceed max_global_steps")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs and token_ids differ in length")
        if self.final and (self.num_turns is None or self.extra_fields is None):
            raise ValueError("the final turn must carry num_turns and extra_fields")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_routing(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_none_routing(handler(self))


class ScoredTrajectory(EventBase):
    """A complete, scored trajectory (topic `rl.scored`, key `uid`)."""

    kind: Literal["scored"] = "scored"
    uid: str = Field(min_length=1)
    trajectory_id: str
    sample_index: int = Field(ge=0)
    attempt_id: str = Field(min_length=1)
    data_source: str
    prompt_ids: IntArray
    response_ids: IntArray
    response_mask: MaskArray
    response_logprobs: FloatArray
    num_turns: int = Field(ge=1, description="verl convention: a single-turn trajectory has 2.")
    reward_score: float
    reward_extra: dict[str, Any] = Field(default_factory=dict)
    tool_rewards: list[float] = Field(default_factory=list)
    turn_scores: list[float] = Field(default_factory=list)
    group_size: int | None = Field(default=None, ge=1, description="Samples of this prompt (n).")
    prompt_digest: str | None = Field(
        default=None, description="`PromptEvent.content_digest()` of the prompt it answers."
    )
    finish_reason: str | None = Field(
        default=None,
        description="Why the last model turn ended (stop, length, …); `length` is a response "
        "cut at its token budget.",
    )
    extra_fields: ExtraFields
    routed_experts: RoutedExperts | None = Field(
        default=None,
        description="MoE policies: the experts each position of prompt_ids + response_ids was "
        "routed to when generated, as far as the rollout fed them (None: dense model).",
    )
    images: list[ImageRef] | None = Field(
        default=None,
        description="The prompt's images by reference, in prompt order (None, off the wire: "
        "a text prompt); the trainer rebuilds the image inputs from them.",
    )

    @property
    def min_global_steps(self) -> int:
        """The oldest policy version of the trajectory (verl keeps it in `extra_fields`; here
        it reads as on `TurnEvent` and `TrainingGroup`)."""
        return self.extra_fields.min_global_steps

    @property
    def max_global_steps(self) -> int:
        """The newest policy version of the trajectory (see `min_global_steps`)."""
        return self.extra_fields.max_global_steps

    @model_validator(mode="after")
    def _consistent(self) -> ScoredTrajectory:
        if self.trajectory_id != trajectory_id(self.uid, self.sample_index):
            raise ValueError("trajectory_id must be '{uid}/{sample_index}'")
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.response_logprobs) != n:
            raise ValueError("response_ids, response_mask and response_logprobs differ in length")
        routed = self.routed_experts
        if routed is not None and routed.tokens > len(self.prompt_ids) + n:
            raise ValueError(
                f"routed_experts cover {routed.tokens} positions, past the "
                f"{len(self.prompt_ids) + n} of prompt_ids + response_ids"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_unset_routing(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_none_routing(handler(self))


class TrainingGroup(EventBase):
    """The samples of one prompt with their advantages (topic `rl.replay`, key `uid`)."""

    kind: Literal["group"] = "group"
    uid: str = Field(min_length=1)
    samples: list[ScoredTrajectory] = Field(min_length=1)
    advantages: list[float]
    min_global_steps: int = Field(ge=0)
    max_global_steps: int = Field(ge=0)
    emitted_at_version: int = Field(ge=0, description="Latest policy version when emitted.")

    @model_validator(mode="after")
    def _consistent(self) -> TrainingGroup:
        if len(self.advantages) != len(self.samples):
            raise ValueError("one advantage per sample")
        if any(s.uid != self.uid for s in self.samples):
            raise ValueError("every sample must belong to the group's uid")
        if self.min_global_steps > self.max_global_steps:
            raise ValueError("min_global_steps must not exceed max_global_steps")
        return self


class WeightTransfer(BaseModel):
    """Where a trainer that broadcasts its weights waits for replicas (`PolicyVersion.transfer`)."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(min_length=3, description="host:port of the trainer's rendezvous store.")
    session: str = Field(
        min_length=1, description="The trainer process's run id: a restarted trainer has another."
    )
    backend: Literal["gloo", "nccl"] = Field(default="gloo", description="Collective backend.")


#: The key of every record of the (compacted) policy topic: compaction keeps the newest version.
POLICY_KEY = "policy"


class PolicyVersion(EventBase):
    """A trained policy the replicas should load (topic `rl.policy`, compacted).

    With `transfer` unset (`trainer.weight_transfer: disk`) the replicas load `path`. With it
    set, the weights come over a process group from the trainer (`workers.weights`); `path`
    is then a checkpoint of this version only when one was written (else ""). A record without
    `transfer` encodes exactly as before the field existed."""

    kind: Literal["policy"] = "policy"
    version: int = Field(ge=0, description="The trainer's global step.")
    path: str = Field(
        default="",
        description="Checkpoint directory on shared storage ('' when none was written).",
    )
    groups_trained: int = Field(default=0, ge=0, description="Training groups consumed so far.")
    samples_trained: int = Field(default=0, ge=0, description="Samples consumed so far.")
    transfer: WeightTransfer | None = Field(
        default=None, description="Set when the weights are broadcast rather than read."
    )

    @model_serializer(mode="wrap")
    def _without_unset_transfer(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("transfer") is None:
            data.pop("transfer", None)  # older readers (extra="forbid") read it unchanged
        return data


ReplicaRole = Literal["policy", "judge"]
"""What a replica serves: `policy` (the model being trained: the agent loops route to it, the
sync controllers load every new version into it) or `judge` (another model the reward stage
asks for verdicts: never routed to by the agent loops, never given the policy's weights)."""


class ReplicaInfo(EventBase):
    """A live inference replica (topic `rl.replicas`, key `replica_id`; tombstone on leave).

    `role` is left off the wire when it is `policy`, so a record of a policy replica reads the
    same to readers that predate it; a record without one is a policy replica."""

    kind: Literal["replica"] = "replica"
    replica_id: str = Field(min_length=1)
    address: str = Field(description="Base URL, e.g. http://127.0.0.1:8100")
    backend: str
    model: str = ""
    version: int = Field(default=0, ge=0)
    role: ReplicaRole = Field(default="policy", description="policy or judge (`ReplicaRole`).")

    @model_serializer(mode="wrap")
    def _without_default_role(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("role") == "policy":
            data.pop("role", None)  # older readers (extra="forbid") read it unchanged
        return data


Event = Annotated[
    PromptEvent | TurnEvent | ScoredTrajectory | TrainingGroup | PolicyVersion | ReplicaInfo,
    Field(discriminator="kind"),
]
