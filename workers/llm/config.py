"""Settings of the LLM client (`workers.llm.client`): timeouts, retries, routing, health.

Apart from the client so that a stage's config can name them without importing the client's
HTTP machinery (aiohttp).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.llm.balancer import Routing

__all__ = ["LLMClientConfig"]


class LLMClientConfig(BaseModel):
    """Settings of `LLMClient` (timeouts, retries, routing, health checks)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="`model` sent with each request.")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="TCP connect timeout.")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="Total time one piece (one HTTP request) may take."
    )
    max_total_time_s: float = Field(
        default=3600.0, gt=0, description="Wall-time cap of one generate call, all pieces."
    )
    max_retries: int = Field(
        default=5,
        ge=0,
        description="Failures in a row tolerated per generate call (progress resets the count).",
    )
    max_idle_aborts: int = Field(
        default=64,
        ge=0,
        description="Aborts in a row with no new token on a replica that is not paused "
        "(weight updates abort requests: frequent ones are not failures).",
    )
    backoff_initial_s: float = Field(default=0.1, gt=0, description="First retry delay.")
    backoff_max_s: float = Field(default=5.0, gt=0, description="Largest retry delay.")
    backoff_multiplier: float = Field(default=2.0, ge=1.0, description="Delay growth per failure.")
    backoff_jitter: float = Field(
        default=0.1, ge=0.0, le=1.0, description="Random extra delay, as a fraction of it."
    )
    no_replica_wait_s: float = Field(
        default=30.0, ge=0, description="How long to wait for a routable replica before failing."
    )
    sticky_size: int = Field(
        default=65536, ge=1, description="Entries of the sticky id->replica LRU."
    )
    deterministic: bool = Field(
        default=False, description="Break routing ties by a stable hash of the request id."
    )
    # `load` is the default: per capacity, `rollout bench routing` showed it ahead in four runs
    # of four on two shared cores (1.35, 1.71, 1.26, 1.55), where the bare count could not
    # (0.74 and 1.81 with the same request split; 1.13 and 1.03 the same day as the four).
    routing: Routing = Field(
        default="load",
        description="`sticky` (sticky LRU, then least in-flight of this process only), `load` "
        "(sticky LRU, then least load as the replicas report it, plus this process's requests "
        "since the report) or `round_robin` (a baseline).",
    )
    load_ttl_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="A replica's load report older than this is unknown (routing `load`): "
        "its load counts as its own in-flight plus the highest fresh load, never as idle.",
    )
    health_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between /health probes of every known replica."
    )
    health_timeout_s: float = Field(default=2.0, gt=0, description="Timeout of one /health probe.")
    health_failures: int = Field(
        default=3, ge=1, description="Consecutive failed probes that take a replica out."
    )
    max_connections: int = Field(
        default=0, ge=0, description="Open HTTP connections in total; 0 means no limit."
    )
    return_routed_experts: bool | None = Field(
        default=None,
        description="Ask for the routed experts of every generation (Mixture-of-Experts "
        "policies, for the trainer's routing replay). None: `rollout worker agent-loop` turns "
        "it on when the model's config.json is MoE; a client built directly reads it as off.",
    )

    @model_validator(mode="after")
    def _check(self) -> LLMClientConfig:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        return self
