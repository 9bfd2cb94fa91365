"""Agent loops: one trajectory's logic, registered by name, returning `AgentLoopOutput`.

An agent loop turns one sample (chat messages + metadata) into one trajectory by calling the
LLM client token-in/token-out. It reports every turn as it completes through
`AgentContext.on_turn` (the worker turns those into `TurnEvent`s on `rl.turns`; the first
turn's record carries the prompt ids), and returns
verl's `AgentLoopOutput`: `prompt_ids`, `response_ids`, `response_mask` (1 model tokens,
0 tool/user tokens), `response_logprobs` (0.0 under mask 0), `num_turns`, `reward_score`,
`metrics`, and `extra_fields` with `min_global_steps`/`max_global_steps`.

Invariant: `response_ids` is exactly the concatenation of the turns' token ids, in order;
text is never re-tokenized. An assistant turn's record carries its generation's
`routed_experts` as the client returned it (None unless the client asks for routing: MoE
policies); the reward stage assembles the trajectory's from them.

Loops are registered with `@register("name")`; `workers.agent_loop.loops` looks them up (it
imports the built-in loops, which import this module: the one-way order base → loops → lookup),
and loads user loops named in config by import path (`package.module:ClassName`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from schemas.routing import RoutedExperts
from workers.agent_loop.chat_format import ChatFormat
from workers.agent_loop.exceptions import AgentLoopError
from workers.llm.contract import SamplingParams

__all__ = [
    "AgentContext",
    "AgentLoopBase",
    "AgentLoopOutput",
    "TurnRecord",
    "register",
    "registered",
]

_REGISTRY: dict[str, type[AgentLoopBase]] = {}


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One completed turn, as the loop reports it."""

    role: Literal["assistant", "tool", "user"]
    token_ids: list[int]
    logprobs: list[float] | None
    min_global_steps: int
    max_global_steps: int
    stop_reason: str | None = None
    tool_reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # required on a trajectory's first turn
    routed_experts: RoutedExperts | None = None  # the generation's, as `GenerateOutput` has it


class AgentLoopOutput(BaseModel):
    """verl's agent-loop output, for one trajectory."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int = Field(ge=1, description="verl: user + assistant turns; single turn = 2.")
    reward_score: float | None = None
    finish_reason: str = "stop"
    metrics: dict[str, Any] = Field(default_factory=dict)
    extra_fields: dict[str, Any] = Field(default_factory=dict)


@dataclass
class AgentContext:
    """What a loop may use: the LLM client, the tokenizer, tools, limits, the turn sink."""

    llm: Any  # workers.llm.client.LLMClient (or anything with its `generate`)
    tokenizer: Any  # a transformers tokenizer with a chat template
    on_turn: Callable[[TurnRecord], Awaitable[None]]
    tools: dict[str, Any] = field(default_factory=dict)  # name → BaseTool
    max_prompt_length: int = 1024
    max_response_length: int = 512
    options: dict[str, Any] = field(default_factory=dict)  # per-loop settings from config
    # The model's chat format (template, stop tokens, tool parser), built once by the worker;
    # None: derived from `tokenizer` (and `options["tool_parser"]`) when a loop first needs it.
    chat: ChatFormat | None = None


class AgentLoopBase(ABC):
    """One trajectory. Subclasses implement `run`; a fresh instance serves each sample."""

    #: Whether `run` uses `sample["images"]` (`workers.agent_loop.images.LoopImages`): a
    #: prompt with images for a loop that does not is dead-lettered, not run on its text.
    takes_images: bool = False

    def __init__(self, context: AgentContext) -> None:
        self.ctx = context

    @abstractmethod
    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        """Roll out one sample. `sample` has `messages`, `request_id`, `extra_info`, `uid`…"""

    @property
    def chat(self) -> ChatFormat:
        """The model's chat format: the worker's, or one derived from the tokenizer."""
        if self.ctx.chat is None:
            parser = self.ctx.options.get("tool_parser")
            self.ctx.chat = ChatFormat.load(
                self.ctx.tokenizer, tool_parser=str(parser) if parser else None
            )
        return self.ctx.chat

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Tokenize the conversation once (with `agent_loop.chat_template_kwargs`); the result
        is the prompt for every later turn."""
        ids = self.chat.prompt_ids(messages, tools)
        if len(ids) > self.ctx.max_prompt_length:
            raise AgentLoopError(
                f"prompt has {len(ids)} tokens, "
                f"over max_prompt_length={self.ctx.max_prompt_length}",
                cause="prompt_too_long",
            )
        return ids


def register(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: make an agent loop selectable by `agent_name`."""

    def wrap(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise AgentLoopError(f"agent loop {name!r} is registered twice", cause="config")
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered() -> dict[str, type[AgentLoopBase]]:
    """The loops registered so far (`workers.agent_loop.loops.registered` has the built-ins)."""
    return dict(_REGISTRY)
