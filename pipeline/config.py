"""The run's configuration: one YAML file, `ROLLOUT_…` environment variables, CLI flags.

Each stage defines its own config model next to its code and receives only that; this module
composes them into `RunConfig`. Precedence, highest first: CLI flags (`--set a.b=v` and the
named flags), environment (`ROLLOUT_KAFKA__BOOTSTRAP_SERVERS=host:9092`: prefix `ROLLOUT_`,
`__` between levels), the YAML file (`--config FILE` or `ROLLOUT_CONFIG`), then defaults.
A wrong value fails at start with `ConfigError` naming the field.

Settings several stages share have one source, and `RunConfig` hands each stage its copy
(`DERIVED`): the trainer's `train_batch_size` and `max_staleness` are the run's, the replay
stage drops at the same bound, and the agent-loop's admission gate admits within it, less
`agent_loop.admission.margin`. The copies are no settings: a file, variable or flag that
names one is refused with the source to set instead, and they stay out of the run's dump
(`exclude=True` in the stage models), so a written config loads again and derives them anew.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from schemas.errors import RolloutError
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.llm.engines.vllm.config import VLLMLaunchConfig
from workers.media.config import MediaConfig
from workers.replay.config import ReplayConfig
from workers.reward.config import RewardConfig
from workers.trainer.config import TrainerConfig
from workers.weights.config import WeightsConfig

__all__ = [
    "DERIVED",
    "RENAMED",
    "RUN_GROUPS",
    "ConfigError",
    "LocalKafkaConfig",
    "RunConfig",
    "closest_keys",
    "load_config",
    "parse_overrides",
]

#: The stage settings the run fills from one source (`RunConfig._derive`): key → source.
DERIVED: dict[str, str] = {
    "agent_loop.admission.max_staleness": "trainer.max_staleness (less "
    "agent_loop.admission.margin)",
    "agent_loop.admission.train_batch_size": "trainer.train_batch_size",
    "agent_loop.media": "media",
    "trainer.media": "media",
    "replay.max_staleness": "trainer.max_staleness",
}


#: Settings that moved: old dotted key → new one (refused under the old name, in one line).
RENAMED: dict[str, str] = {
    "trainer.weight_transfer": "weights.mode",
    "weight_transfer": "weights (weight_transfer.X is weights.X)",
}

#: The consumer group of each stage section, named `{topics.prefix}{stage}` unless set.
RUN_GROUPS: dict[str, str] = {
    "agent_loop": "agent-loop",
    "reward": "reward",
    "replay": "replay",
    "trainer": "trainer",
}


class ConfigError(RolloutError):
    """The configuration is invalid; the message names each wrong field."""


class LocalKafkaConfig(BaseModel):
    """The broker `rollout kafka up` and `make` start when none is configured."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(default=9092, ge=1, le=65535, description="Client port on localhost.")
    data_dir: str | None = Field(default=None, description="Default: ~/.rollout/kafka-<port>.")
    heap: str = Field(default="1g", pattern=r"^\d+[mg]$", description="JVM heap, e.g. 1g.")
    advertised_host: str = Field(
        default="localhost",
        min_length=1,
        description="The host the broker tells its clients to connect to (its advertised "
        "listener). localhost serves this machine only; for a run on several nodes, this "
        "machine's address they reach (the broker then listens on every interface).",
    )
    cluster_heap: str = Field(
        default="512m",
        pattern=r"^\d+[mg]$",
        description="JVM heap of each broker of `rollout kafka up --brokers N` (N JVMs share it).",
    )


class ProduceConfig(BaseModel):
    """Defaults for `rollout produce` and `PromptProducer`."""

    model_config = ConfigDict(extra="forbid")

    default_data_source: str = Field(default="openai/gsm8k", description="When a row has none.")
    rate: float | None = Field(default=None, gt=0, description="Prompts per second; None = max.")


class RunConfig(BaseSettings):
    """Everything one run of the pipeline is configured by."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLOUT_",
        env_nested_delimiter="__",
        extra="forbid",
        yaml_file=None,
    )

    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    local_kafka: LocalKafkaConfig = Field(default_factory=LocalKafkaConfig)
    produce: ProduceConfig = Field(default_factory=ProduceConfig)
    media: MediaConfig = Field(default_factory=MediaConfig)
    agent_loop: AgentLoopWorkerConfig = Field(default_factory=AgentLoopWorkerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    vllm: VLLMLaunchConfig = Field(default_factory=VLLMLaunchConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)

    @model_validator(mode="before")
    @classmethod
    def _no_derived_settings(cls, data: Any) -> Any:
        """Refuse a derived copy given as a setting (from a file, variable, flag or dict), and
        a setting under its old name, saying the new one."""
        for key, source in DERIVED.items():
            if _names(data, key):
                raise ValueError(f"{key} is derived from {source}: set that instead")
        for old, new in RENAMED.items():
            if _names(data, old):
                raise ValueError(f"{old} is renamed to {new}")
        return data

    @model_validator(mode="after")
    def _derive(self) -> RunConfig:
        """Each stage's copy of the settings several stages share, from their one source."""
        self._name_after_run()
        if self.weights.mode == "broadcast" and self.trainer.nproc > 1:
            raise ValueError(
                f"weights.mode=broadcast runs with one trainer process, not "
                f"trainer.nproc={self.trainer.nproc}"
            )
        trainer, gate = self.trainer, self.agent_loop.admission
        # Inside the trainer's bound by the margin: a gate looser than the bound would
        # generate what the stages downstream are sure to drop.
        bound = (
            None if trainer.max_staleness is None else max(0, trainer.max_staleness - gate.margin)
        )
        gate = gate.model_copy(
            update={"max_staleness": bound, "train_batch_size": trainer.train_batch_size}
        )
        self.agent_loop = self.agent_loop.model_copy(
            update={"admission": gate, "media": self.media}
        )
        self.replay = self.replay.model_copy(update={"max_staleness": trainer.max_staleness})
        self.trainer = self.trainer.model_copy(update={"media": self.media})
        overlong = self.reward.overlong
        if overlong.enabled and overlong.max_response_length is None:
            # The penalty's budget is the agent loop's, unless the reward stage names one.
            budget = self.agent_loop.sampling.max_tokens
            if overlong.buffer_len > budget:
                raise ValueError(
                    f"reward.overlong.buffer_len ({overlong.buffer_len}) exceeds "
                    f"agent_loop.sampling.max_tokens ({budget})"
                )
            self.reward.overlong = overlong.model_copy(update={"max_response_length": budget})
        return self

    def _name_after_run(self) -> None:
        """What a run keeps of its own is named after its topics unless set: each stage's
        consumer group (and so the reward and replay stages' changelogs) and the trainer's
        checkpoints. Two runs under two prefixes then share no offsets, no state and no
        checkpoint; the same prefix again is the same run, which resumes."""
        prefix = self.topics.prefix
        for section, stage in RUN_GROUPS.items():
            model = getattr(self, section)
            if "group_id" not in model.model_fields_set:
                setattr(self, section, model.model_copy(update={"group_id": f"{prefix}{stage}"}))
        if "checkpoint_dir" not in self.trainer.model_fields_set:
            where = str(Path("runs") / self.topics.run_name / "checkpoints")
            self.trainer = self.trainer.model_copy(update={"checkpoint_dir": where})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = settings_cls.model_config.get("yaml_file")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    def redacted(self) -> dict[str, Any]:
        """The resolved config as plain data, secrets masked (to write next to outputs)."""
        return self.model_dump(mode="json")


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["kafka.bootstrap_servers=h:9092", "topics.prompts.partitions=8"]` → nested dict.

    Values are parsed as YAML scalars/lists (`8` is an int, `[a, b]` a list, `x` a string).
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        path, sep, raw = pair.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set expects key.path=value, got {pair!r}")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {pair!r}: not a YAML value: {_yaml_problem(exc)}") from exc
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {pair!r} conflicts with another --set")
        node[leaf] = value
    return out


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> RunConfig:
    """Load and validate the run's config; `ConfigError` names every wrong field."""
    path = path or os.environ.get("ROLLOUT_CONFIG")
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"config file {path} is not valid YAML: {_yaml_problem(exc)}"
            ) from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top")

    class _Run(RunConfig):
        model_config = SettingsConfigDict(yaml_file=str(path) if path else None)

    try:
        run = _Run(**(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from exc
    except SettingsError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    return RunConfig.model_construct(
        **{name: getattr(run, name) for name in RunConfig.model_fields}
    )


def _names(data: Any, key: str) -> bool:
    """Whether the raw settings `data` give the dotted `key` (models built in code are
    derived over, not refused)."""
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what is wrong and where (its str() is a drawing)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return str(exc).splitlines()[0]
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"


def _describe(exc: ValidationError, path: str | Path | None) -> str:
    where = f" (from {path}, ROLLOUT_* variables and flags)" if path else ""
    lines = [f"invalid configuration{where}:"]
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        hint = ""
        if err["type"] == "extra_forbidden":
            *parent, name = (str(p) for p in err["loc"])
            close = closest_keys(name, _field_names(parent))
            named = " or ".join(".".join([*parent, c]) for c in close)
            hint = f"; did you mean {named}?" if close else ""
        lines.append(f"  {field}: {err['msg']}{hint}")
    return "\n".join(lines)


def closest_keys(name: str, known: list[str]) -> list[str]:
    """The known keys `name` is most likely a misspelling of (at most two)."""
    import difflib

    return difflib.get_close_matches(name, known, n=2, cutoff=0.6)


def _field_names(path: list[str]) -> list[str]:
    """The fields of the config model at dotted `path` under `RunConfig` ([] if not a model)."""
    model: Any = RunConfig
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))
