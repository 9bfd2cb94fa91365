"""`RewardConfig`: everything the reward stage is configured by, and nothing else.

Imports no Kafka client, torch or transformers (the CLI parses it before anything heavy loads).
Scorer dispatch, in order: `custom` when set; else the LLM judge (`judge`) when enabled; else
`reward_model` when enabled; else the rule-based scorer that `data_sources` maps the
trajectory's `data_source` to. A generative reward model is the judge (`reward.judge`: its
replicas, a prompt template and a verdict parser), or a custom function that calls one; a
generative `reward_model` without either is rejected here, at start.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workers.kafka.stage_config import StageLoopConfig, group_id_field, sweep_interval_field
from workers.llm.config import LLMClientConfig
from workers.reward.overlong import OverlongConfig
from workers.reward.verdict import check_pattern, check_template

__all__ = [
    "DEFAULT_DATA_SOURCES",
    "CustomRewardConfig",
    "Gsm8kConfig",
    "JudgeConfig",
    "MathConfig",
    "RewardConfig",
    "RewardModelConfig",
]

RuleScorer = Literal["gsm8k", "math"]

#: verl's `default_compute_score` routing, plus short aliases.
DEFAULT_DATA_SOURCES: dict[str, RuleScorer] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
}


class Gsm8kConfig(BaseModel):
    """The gsm8k rule (verl's `gsm8k.compute_score`)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["strict", "flexible"] = Field(
        default="strict", description="strict: last '#### n'; flexible: last number."
    )
    format_score: float = Field(default=0.0, description="Score of a wrong but present answer.")
    score: float = Field(default=1.0, description="Score of a correct answer.")


class MathConfig(BaseModel):
    """The math rule: final answer from \\boxed{} or 'Answer:', checked by math-verify."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="Per item; the pool kills a worker past it."
    )
    format_score: float = Field(default=0.0, description="Score of a wrong but present answer.")
    score: float = Field(default=1.0, description="Score of a correct answer.")


class CustomRewardConfig(BaseModel):
    """A user function `fn(solution_str, ground_truth, data_source, extra_info, trajectory)`.

    It may be sync or async and return a float or a dict with a `score` key (the other keys
    become `reward_extra`). `executor` says where a sync function runs: `thread` (default;
    receives the `ScoredTrajectory` draft), or `process` (the scorer pool, killable on
    timeout; receives the trajectory as a JSON dict). Async functions run on the loop.
    """

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="Importable module path, e.g. 'my_pkg.reward'.")
    name: str = Field(default="compute_score", min_length=1, description="Function name.")
    executor: Literal["thread", "process"] = Field(
        default="thread",
        description="Where a sync function runs: a thread, or the scorer pool (killable).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments.")


class RewardModelConfig(BaseModel):
    """A reward model served by replicas' `POST /classify` (discriminative) or called by a
    custom function (generative)."""

    model_config = ConfigDict(extra="forbid")

    enable: bool = Field(default=False, description="Score with the reward model.")
    style: Literal["discriminative", "generative"] = Field(
        default="discriminative",
        description="discriminative: scores from /classify; generative: a custom function.",
    )
    addresses: list[str] = Field(
        default_factory=list, description="Base URLs of replicas serving /classify."
    )
    timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Per /classify request.")
    max_batch: int = Field(default=64, ge=1, le=4096, description="Sequences per request.")


DEFAULT_JUDGE_TEMPLATE = (
    "Grade the answer to the question below against the reference answer.\n\n"
    "Question:\n{prompt}\n\nReference answer: {ground_truth}\n\nAnswer:\n{response}\n\n"
    "End your reply with 'Verdict: 1' if the answer is correct, 'Verdict: 0' if it is not."
)


class JudgeConfig(BaseModel):
    """An LLM judge (a generative reward model) on replicas of its own: `rl.replicas` role
    `judge`, which the agent loops never route to and no weight update reaches.

    Each trajectory's prompt and response (decoded with `reward.tokenizer`) and its reference
    answer fill `template`; the judge's tokenizer (`model`) encodes it, through its chat
    template unless `chat_template` is off; the judge answers through the LLM client (sticky,
    least-loaded, resumed on another replica when one fails), many trajectories at once; the
    last match of `verdict` in the answer is the score (`workers.reward.verdict`). An answer
    without one gets `failure_score`, tagged (`reward_error_cause: unparseable_verdict`), and
    is counted (`unparseable_verdicts`)."""

    model_config = ConfigDict(extra="forbid")

    enable: bool = Field(default=False, description="Score every trajectory with the judge.")
    model: str | None = Field(
        default=None,
        description="The judge's model directory: its tokenizer writes the judge's prompts, and "
        "the launchers serve it.",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=64,
        description="Judge replicas the launchers start on the trainer's resources (colocated;"
        " 0: none, the judge runs elsewhere).",
    )
    threads: int = Field(
        default=1, ge=1, le=256, description="torch threads of each judge replica launched (hf)."
    )
    addresses: list[str] = Field(
        default_factory=list,
        description="Judge replica URLs; empty: every replica registered on rl.replicas with "
        "role judge.",
    )
    template: str = Field(
        default=DEFAULT_JUDGE_TEMPLATE,
        min_length=1,
        description="The judge's prompt: {prompt}, {response}, {ground_truth}, {data_source} "
        "(a literal brace doubled).",
    )
    chat_template: bool = Field(
        default=True,
        description="Send the prompt as one user message through the judge's chat template.",
    )
    verdict: str = Field(
        default=r"Verdict:\s*([-+]?\d+(?:\.\d+)?)",
        min_length=1,
        description="Regular expression with one capture group; its last match in the answer "
        "is the verdict.",
    )
    verdict_scores: dict[str, float] = Field(
        default_factory=dict,
        description="Verdict text (case-insensitive) → score; empty: the verdict is a number, "
        "the score.",
    )
    failure_score: float = Field(
        default=0.0, description="Score of a trajectory whose verdict cannot be parsed (tagged)."
    )
    max_tokens: int = Field(default=64, ge=1, le=65536, description="Tokens the judge may answer.")
    temperature: float = Field(default=0.0, ge=0.0, description="Judge sampling; 0 is greedy.")
    max_in_flight: int = Field(
        default=64, ge=1, le=65536, description="Verdicts asked for at once, at most."
    )
    timeout_s: float = Field(
        default=300.0, gt=0, le=86400, description="Per trajectory, for its verdict."
    )
    llm: LLMClientConfig = Field(
        default_factory=lambda: LLMClientConfig(no_replica_wait_s=300.0),
        description="The judge's LLM client: timeouts, retries, routing, health checks.",
    )

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        check_template(value)
        return value

    @field_validator("verdict")
    @classmethod
    def _verdict(cls, value: str) -> str:
        check_pattern(value)
        return value

    @model_validator(mode="after")
    def _model(self) -> JudgeConfig:
        if self.enable and not self.model:
            raise ValueError("judge.enable needs judge.model (the judge's model directory)")
        scores = [self.failure_score, *self.verdict_scores.values()]
        if not all(math.isfinite(score) for score in scores):
            raise ValueError("judge.failure_score and judge.verdict_scores must be finite")
        return self


class RewardConfig(StageLoopConfig):
    """The reward stage: `rl.turns` → assembled, scored trajectories on `rl.scored`."""

    group_id: str = group_id_field("rollout-reward")
    batch_size: int = Field(default=1024, ge=1, le=65536, description="Most turns per batch.")
    sweep_interval_s: float = sweep_interval_field(
        30.0,
        "With no turns arriving for this long, the stage still sweeps its table: it expires"
        " finished trajectories and abandons stuck ones (every batch sweeps too).",
    )
    tokenizer: str | None = Field(
        default=None, description="Directory for AutoTokenizer.from_pretrained (decodes responses)."
    )
    done_retention_s: float = Field(
        default=3600.0,
        gt=0,
        description=(
            "How long a finished trajectory's DONE state is kept (it drops the trajectory's"
            " late turns: redeliveries, restarted attempts); then it is deleted from the table"
            " and its changelog, so neither grows with every trajectory ever scored."
        ),
    )
    abandon_after_s: float = Field(
        default=7200.0,
        gt=0,
        description=(
            "A trajectory still assembling with no new turn for this long is abandoned (its"
            " agent loop died, or its attempt was never restarted): each turn it holds goes to"
            " rl.dlq byte for byte (cause 'abandoned'), and its state is deleted from the table"
            " and its changelog."
        ),
    )
    pool_workers: int = Field(default=2, ge=1, le=256, description="Scorer pool processes.")
    scorer_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="Per trajectory, custom and RM scorers."
    )
    on_failure: Literal["dlq", "score"] = Field(
        default="dlq",
        description="A scorer that raises or times out: dead-letter, or emit failure_score.",
    )
    failure_score: float = Field(default=0.0, description="Score when on_failure='score'.")
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig,
        description="DAPO's soft overlong punishment added to every rule/custom score.",
    )
    gsm8k: Gsm8kConfig = Field(default_factory=Gsm8kConfig)
    math: MathConfig = Field(default_factory=MathConfig)
    custom: CustomRewardConfig | None = Field(default=None, description="Overrides all scorers.")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig, description="An LLM judge on replicas of its own."
    )
    data_sources: dict[str, RuleScorer] = Field(
        default_factory=lambda: dict(DEFAULT_DATA_SOURCES),
        description="data_source → rule scorer; unknown ones are dead-lettered.",
    )

    @model_validator(mode="after")
    def _dispatch(self) -> RewardConfig:
        rm = self.reward_model
        if rm.enable and self.judge.enable and self.custom is None:
            raise ValueError(
                "reward_model.enable and judge.enable both choose the scorer; enable one "
                "(a generative reward model is the judge)"
            )
        if rm.enable and rm.style == "generative" and self.custom is None:
            raise ValueError(
                "reward_model.style='generative' needs reward.judge (judge.enable, judge.model) "
                "or a custom reward function (reward.custom.path/name) that calls the model"
            )
        if rm.enable and rm.style == "discriminative" and self.custom is None and not rm.addresses:
            raise ValueError("reward_model.enable needs reward_model.addresses (/classify URLs)")
        return self

    def unscorable(self, data_source: str, ground_truth: object) -> str | None:
        """Why this stage could not score a prompt of `data_source` with `ground_truth` (None:
        it can). Only the rule scorers need anything of a prompt; a custom function, a reward
        model or a judge take any. `rollout produce` asks before it sends a row, so a prompt
        the stage would dead-letter is refused before any compute is spent on it."""
        if self.scorer_kind != "rule":
            return None
        scorer = self.data_sources.get(data_source)
        if scorer is None:
            known = ", ".join(sorted(self.data_sources))
            return (
                f"no scorer for data_source {data_source!r} (reward.data_sources knows {known}; "
                "reward.custom scores any)"
            )
        if ground_truth is None:
            return f"the {scorer} scorer needs reward_model.ground_truth; the row has none"
        return None

    @property
    def changelog_topic(self) -> str:
        """The compacted topic trajectory states are kept in (as many partitions as rl.turns)."""
        return f"{self.group_id}-trajectories-changelog"

    def missing_for_start(self) -> str | None:
        """What the stage lacks to start (checked at start, so defaults stay valid)."""
        if self.scorer_kind != "reward_model" and self.tokenizer is None:
            return "reward.tokenizer is required to decode responses for scoring"
        return None

    @property
    def scorer_kind(self) -> Literal["custom", "judge", "reward_model", "rule"]:
        """Which scorer every trajectory goes to (dispatch is per stage, not per item)."""
        if self.custom is not None:
            return "custom"
        if self.judge.enable:
            return "judge"
        if self.reward_model.enable:
            return "reward_model"
        return "rule"
