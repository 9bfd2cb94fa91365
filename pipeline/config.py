"""The run's configuration: one YAML file, `ROLLOUT_…` environment variables, CLI flags.

Each stage defines its own config model next to its code and receives only that; this module
composes them into `RunConfig`. Precedence, highest first: CLI flags (`--set a.b=v` and the
named flags), environment (`ROLLOUT_KAFKA__BOOTSTRAP_SERVERS=host:9092`: prefix `ROLLOUT_`,
`__` between levels), the YAML file (`--config FILE` or `ROLLOUT_CONFIG`), then defaults.
A wrong value fails at start with `ConfigError` naming the field.
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
from workers.llm.replicas.vllm_config import VLLMLaunchConfig
from workers.replay.config import ReplayConfig
from workers.reward.config import RewardConfig
from workers.trainer.config import TrainerConfig

__all__ = ["ConfigError", "LocalKafkaConfig", "RunConfig", "load_config", "parse_overrides"]


class ConfigError(RolloutError):
    """The configuration is invalid; the message names each wrong field."""


class LocalKafkaConfig(BaseModel):
    """The broker `rollout kafka up` and `make` start when none is configured."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(default=9092, ge=1, le=65535, description="Client port on localhost.")
    data_dir: str | None = Field(default=None, description="Default: ~/.rollout/kafka-<port>.")
    heap: str = Field(default="1g", pattern=r"^\d+[mg]$", description="JVM heap, e.g. 1g.")


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
    agent_loop: AgentLoopWorkerConfig = Field(default_factory=AgentLoopWorkerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    vllm: VLLMLaunchConfig = Field(default_factory=VLLMLaunchConfig)

    @model_validator(mode="after")
    def _stages_agree(self) -> RunConfig:
        """Settings that several stages must share, checked once for the whole run."""
        gate = self.agent_loop.admission
        if gate.max_staleness is not None:
            if gate.train_batch_size != self.trainer.train_batch_size:
                raise ValueError(
                    "agent_loop.admission.train_batch_size must equal trainer.train_batch_size"
                )
            for name, value in (
                ("trainer", self.trainer.max_staleness),
                ("replay", self.replay.max_staleness),
            ):
                # A gate tighter than the drop bound is slack for late groups; a looser one
                # would generate what the stages downstream are sure to drop.
                if value is not None and value < gate.max_staleness:
                    raise ValueError(
                        f"{name}.max_staleness ({value}) is below "
                        f"agent_loop.admission.max_staleness ({gate.max_staleness}): the gate "
                        "would admit samples the stage drops"
                    )
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
        lines.append(f"  {field}: {err['msg']}")
    return "\n".join(lines)
