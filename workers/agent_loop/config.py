"""Configuration of the agent-loop worker (`rollout worker agent-loop`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.llm.config import LLMClientConfig
from workers.llm.contract import SamplingParams
from workers.media.config import MediaConfig

__all__ = ["AdmissionConfig", "AgentLoopConfig", "AgentLoopWorkerConfig"]


class AdmissionConfig(BaseModel):
    """Staleness bounded at the source: how far generation may run ahead of training.

    The gate's bound is the trainer's: in a run, `pipeline.config.RunConfig` fills
    `max_staleness` (`trainer.max_staleness` less `margin`, at least 0) and `train_batch_size`
    (`trainer.train_batch_size`). Those two are no settings of a run (a file, variable or flag
    that names one is refused) and stay out of its dump; code that builds a worker without a
    run sets them here directly. `margin` is the one setting of the gate.
    """

    model_config = ConfigDict(extra="forbid")

    margin: int = Field(
        default=0,
        ge=0,
        description="Versions the gate keeps generation inside trainer.max_staleness: slack for "
        "groups admitted late (its count of started groups is up to a second old).",
    )
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        exclude=True,
        description="Derived. None: unbounded. 0: on-policy (wait for each version).",
    )
    train_batch_size: int = Field(
        default=8, ge=1, exclude=True, description="Derived. Groups (prompts) per trainer step."
    )


class AgentLoopConfig(BaseModel):
    """What every agent loop gets: limits, tools, per-loop options."""

    model_config = ConfigDict(extra="forbid")

    default_agent: str = Field(default="single_turn_agent", description="When a prompt names none.")
    user_loops: dict[str, str] = Field(
        default_factory=dict, description="name → 'package.module:Class' of user agent loops."
    )
    tool_config: str | None = Field(default=None, description="YAML file of tools for tool_agent.")
    max_prompt_length: int = Field(
        default=1024, ge=1, description="Longer prompts (in tokens) are dead-lettered."
    )
    max_response_length: int = Field(
        default=512, ge=1, description="Token budget of a whole trajectory's response."
    )
    options: dict[str, object] = Field(
        default_factory=lambda: {
            "max_assistant_turns": 5,
            "max_user_turns": 5,
            "max_parallel_calls": 4,
            "tool_timeout_s": 60.0,
            "max_tool_response_length": 256,
            "tool_response_truncate_side": "middle",
        },
        description="Options passed to the loops (tool_agent's turn limits, …).",
    )


class AgentLoopWorkerConfig(BaseModel):
    """The agent-loop worker: Kafka group, concurrency, sampling, the LLM client, loops."""

    model_config = ConfigDict(extra="forbid")

    group_id: str = Field(
        default="agent-loop",
        min_length=1,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Consumer group on the prompts topic; default in a run: "
        "`{topics.prefix}agent-loop`.",
    )
    model: str = Field(default="", description="Model directory (tokenizer and chat template).")
    tool_parser: str | None = Field(
        default=None,
        description="Tool-call parser: hermes, llama3_json, mistral, qwen3_coder, deepseek_v3, "
        "a parser registered with register_parser, or 'package.module:Class'; None: the one "
        "the model's chat template is written for (hermes if none is recognised).",
    )
    chat_template_kwargs: dict[str, object] = Field(
        default_factory=dict,
        description="Extra variables for every rendering of the chat template "
        "(e.g. {enable_thinking: false} for Qwen3).",
    )
    n: int = Field(
        default=4, ge=1, le=1024, description="Samples per prompt unless the prompt says."
    )
    max_samples_in_flight: int = Field(default=64, ge=1, description="Backpressure bound.")
    commit_interval_s: float = Field(
        default=1.0, gt=0, description="Seconds between commits of the finished offsets."
    )
    grace_period_s: float = Field(default=30.0, ge=0, description="On SIGTERM, finish within this.")
    turns_linger_ms: int = Field(
        default=20,
        ge=0,
        le=1000,
        description="How long the turns producer waits to fill a batch: more turns per produce "
        "request, fewer requests for the worker and the broker to handle. A sample's slot is "
        "free before its turns are acknowledged, so the wait costs no generation.",
    )
    replicas: list[str] = Field(
        default_factory=list,
        description="Replica URLs; empty: discover them on the replicas topic.",
    )
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(max_tokens=256))
    llm: LLMClientConfig = Field(default_factory=LLMClientConfig)
    loops: AgentLoopConfig = Field(default_factory=AgentLoopConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    media: MediaConfig = Field(
        default_factory=MediaConfig,
        exclude=True,
        description="Derived from the run's `media`: the store the prompts' images are read from.",
    )

    @model_validator(mode="after")
    def _parser_option(self) -> AgentLoopWorkerConfig:
        """`loops.options.tool_parser`, where the parser was chosen before, still chooses it."""
        old = self.loops.options.pop("tool_parser", None)
        if old is not None and self.tool_parser is not None and str(old) != self.tool_parser:
            raise ValueError(
                f"loops.options.tool_parser ({old}) and tool_parser ({self.tool_parser}) "
                "differ: set tool_parser only"
            )
        if old is not None:
            self.tool_parser = str(old)
        return self

    @model_validator(mode="after")
    def _budget(self) -> AgentLoopWorkerConfig:
        if self.sampling.max_tokens > self.loops.max_response_length:
            raise ValueError("sampling.max_tokens must not exceed loops.max_response_length")
        return self
