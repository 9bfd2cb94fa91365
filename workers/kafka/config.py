"""Kafka client settings and topic names: the one config every stage receives.

`KafkaConfig` holds what any Kafka client needs (bootstrap servers, security protocol, SASL
and SSL options, timeouts, the largest record); `workers.kafka.clients` makes every producer,
consumer and admin client of both client libraries from it, so every client of every stage
connects the same way from config alone.
Secrets are `SecretStr`: they never appear in reprs, logs or the resolved config on disk.
`TopicsConfig` names the topics (prefix + name) and how they are created.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

__all__ = ["KafkaConfig", "TopicSpec", "TopicsConfig"]

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaConfig(BaseModel):
    """How to reach the Kafka cluster. Passed to every client of every stage."""

    model_config = ConfigDict(extra="forbid")

    # NoDecode: `ROLLOUT_KAFKA__BOOTSTRAP_SERVERS=a:9092,b:9092` is split below, not JSON-parsed.
    bootstrap_servers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["localhost:9092"],
        description="host:port of one or more brokers; a comma-separated string is accepted.",
    )
    client_id: str = Field(default="rollout", description="Prefix of every client's id.")
    security_protocol: SecurityProtocol = Field(
        default="PLAINTEXT", description="How clients talk to the brokers: TLS and/or SASL."
    )
    sasl_mechanism: SaslMechanism | None = Field(default=None, description="With SASL_* only.")
    sasl_username: str | None = Field(default=None, description="SASL user (SASL_* only).")
    sasl_password: SecretStr | None = Field(
        default=None, description="SASL password; give it by environment, not in a file."
    )
    ssl_cafile: str | None = Field(default=None, description="CA bundle to verify the brokers.")
    ssl_certfile: str | None = Field(default=None, description="Client certificate (mTLS).")
    ssl_keyfile: str | None = Field(default=None, description="Private key of ssl_certfile.")
    ssl_password: SecretStr | None = Field(default=None, description="Password of ssl_keyfile.")
    ssl_check_hostname: bool = Field(
        default=True, description="Check that a broker's certificate names its host."
    )
    request_timeout_ms: int = Field(
        default=30_000, ge=1_000, description="How long a client waits for a broker's answer."
    )
    bootstrap_timeout_ms: int = Field(
        default=5_000,
        ge=100,
        description="How long a new client tries to reach a broker before it gives up.",
    )
    delivery_timeout_ms: int = Field(
        default=120_000,
        ge=10_000,
        description=(
            "How long a producer keeps retrying a record (through a broker's loss and the "
            "election of new leaders) before it fails it; kafka-python's delivery.timeout.ms."
        ),
    )
    max_request_size: int = Field(
        default=16 * 1024 * 1024, ge=1024 * 1024, description="Largest message a producer sends."
    )

    @model_validator(mode="after")
    def _delivery(self) -> KafkaConfig:
        if self.delivery_timeout_ms < self.request_timeout_ms:
            raise ValueError("delivery_timeout_ms must be at least request_timeout_ms")
        return self

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one bootstrap server is needed")
        for server in value:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{server!r} is not host:port")
        return value

    @model_validator(mode="after")
    def _sasl(self) -> KafkaConfig:
        if self.security_protocol.startswith("SASL"):
            if self.sasl_mechanism is None:
                raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism")
            if not self.sasl_username or self.sasl_password is None:
                raise ValueError("SASL needs sasl_username and sasl_password")
        return self

    @property
    def bootstrap(self) -> str:
        return ",".join(self.bootstrap_servers)


class TopicSpec(BaseModel):
    """How one topic is created."""

    model_config = ConfigDict(extra="forbid")

    partitions: int = Field(
        default=4,
        ge=1,
        le=10_000,
        description="How many consumers of one group can share the topic.",
    )
    cleanup_policy: Literal["delete", "compact"] = Field(
        default="delete", description="compact keeps the latest value per key."
    )
    retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=-1, description="-1 keeps forever.")


def _spec(**kwargs: Any) -> Any:
    return Field(default_factory=lambda: TopicSpec(**kwargs))


class TopicsConfig(BaseModel):
    """Topic names (`prefix` + name) and how each is created."""

    model_config = ConfigDict(extra="forbid")

    prefix: str = Field(default="rl.", description="Prepended to every topic name.")
    replication_factor: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Replicas of every topic; unset: 3 on a cluster of 3 or more brokers (production), "
            "1 on one broker."
        ),
    )
    min_insync_replicas: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Replicas that must have a write before it is acknowledged (acks=all); unset: 2 "
            "when the topics are replicated 3 or more, else 1."
        ),
    )
    max_message_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024 * 1024,
        description="Largest message a topic accepts; long trajectories need MiBs.",
    )
    create_missing: Literal["local", "always", "never"] = Field(
        default="local",
        description=(
            "When `rollout produce` finds the run's topics missing: create them as `rollout "
            "topics create` would (always, or local: only on a broker at localhost), or fail "
            "naming that command (never)."
        ),
    )
    prompts: TopicSpec = _spec()
    turns: TopicSpec = _spec()
    scored: TopicSpec = _spec()
    replay: TopicSpec = _spec()
    stale: TopicSpec = _spec()
    policy: TopicSpec = _spec(partitions=1, cleanup_policy="compact", retention_ms=-1)
    replicas: TopicSpec = _spec(partitions=1, cleanup_policy="compact", retention_ms=-1)
    dlq: TopicSpec = _spec(partitions=1, retention_ms=30 * 24 * 3600 * 1000)

    @model_validator(mode="after")
    def _isr(self) -> TopicsConfig:
        isr, replicas = self.min_insync_replicas, self.replication_factor
        if isr is not None and replicas is not None and isr > replicas:
            raise ValueError("min_insync_replicas cannot exceed replication_factor")
        return self

    def replication_for(self, brokers: int) -> tuple[int, int]:
        """(replication factor, min.insync.replicas) of the topics on a cluster of `brokers`:
        the configured values, else 3 and 2 on three brokers or more, 1 and 1 below. A
        replication factor larger than the cluster is kept (the broker refuses it, naming it)."""
        replicas = self.replication_factor or (3 if brokers >= 3 else 1)
        isr = self.min_insync_replicas or (2 if replicas >= 3 else 1)
        return replicas, min(isr, replicas)

    ROLES: ClassVar[tuple[str, ...]] = (
        "prompts",
        "turns",
        "scored",
        "replay",
        "stale",
        "policy",
        "replicas",
        "dlq",
    )

    def name(self, role: str) -> str:
        """The full topic name of a role, e.g. `name("turns") == "rl.turns"`."""
        if role not in self.ROLES:
            raise KeyError(f"unknown topic role {role!r}")
        return f"{self.prefix}{role}"

    def spec(self, role: str) -> TopicSpec:
        self.name(role)
        spec: TopicSpec = getattr(self, role)
        return spec

    def all_names(self) -> dict[str, str]:
        return {role: self.name(role) for role in self.ROLES}

    @property
    def run_name(self) -> str:
        """The run these topics belong to: the prefix without its trailing separators
        (`rl.` → `rl`, `exp7.` → `exp7`; `run` for an empty prefix). A run's directory
        (`runs/<run_name>`) and its consumer groups are named after it."""
        return self.prefix.rstrip("._-") or "run"
