"""Prometheus metrics of the pipeline's processes: one interface, one set of names.

Every long-running stage process holds one `StageMetrics(stage)` (the trainer a
`TrainerMetrics`) and feeds it where its own counters count; `serve(port)` exposes it at
`http://HOST:PORT/metrics` from a daemon thread. Replicas serve `replica_families(...)` on
their own HTTP port instead. The names are a contract (the Grafana dashboard and the
Prometheus config are built on them); `NAMES` lists every family:

    rollout_messages_consumed_total{stage,topic}     counter   records read from a topic
    rollout_messages_produced_total{stage,topic}     counter   records written (rl.dlq too)
    rollout_dead_letters_total{stage,reason}         counter   reason: the error's class name
    rollout_in_flight_samples{stage}                 gauge     work held, per stage's meaning
    rollout_turn_latency_seconds{stage}              histogram agent-loop: one turn
    rollout_trajectory_latency_seconds{stage}        histogram whole trajectory
    rollout_staleness{stage}                         histogram versions, buckets 0..8
    rollout_policy_version{stage}                    gauge     latest version the process knows
    rollout_judge_verdicts_total{stage,outcome}      counter   reward stage's LLM judge: parsed,
                                                               unparseable or failed (no answer)
    rollout_trainer_steps_total{stage}               counter   (trainer only, stage="train")
    rollout_trainer_loss / _reward_mean{stage}       gauge     of the last step
    rollout_trainer_importance_weight_mean / _max{stage}  gauge  truncated IS weights, last step
    rollout_replica_*{replica}                       (replicas: see `replica_families`)

Invariants: every stage family carries exactly the label `stage`, one of `STAGES`, fixed per
object; each object has a registry of its own (no module-level state), so several in one
process (tests, a launcher) never clash. Gauges that mirror state the stage already keeps
are read at scrape time (`watch`), never copied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas.errors import RolloutError

__all__ = [
    "NAMES",
    "STAGES",
    "MetricsServerError",
    "ReplicaCounters",
    "Stage",
    "StageMetrics",
    "TrainerMetrics",
    "prometheus_totals",
    "render_replica_metrics",
    "replica_families",
]

log = logging.getLogger("rollout.metrics")

Stage = Literal["agent-loop", "reward", "replay", "train", "sync"]
STAGES: tuple[str, ...] = get_args(Stage)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
STALENESS_BUCKETS = tuple(float(v) for v in range(9))  # 0..8 versions, then +Inf

NAMES = (
    "rollout_messages_consumed_total",
    "rollout_messages_produced_total",
    "rollout_dead_letters_total",
    "rollout_in_flight_samples",
    "rollout_turn_latency_seconds",
    "rollout_trajectory_latency_seconds",
    "rollout_staleness",
    "rollout_policy_version",
    "rollout_judge_verdicts_total",
    "rollout_trainer_steps_total",
    "rollout_trainer_loss",
    "rollout_trainer_reward_mean",
    "rollout_trainer_importance_weight_mean",
    "rollout_trainer_importance_weight_max",
    "rollout_replica_in_flight",
    "rollout_replica_running_requests",
    "rollout_replica_waiting_requests",
    "rollout_replica_generated_tokens_total",
    "rollout_replica_prefix_cache_queries_total",
    "rollout_replica_prefix_cache_hits_total",
    "rollout_replica_prefix_cache_hit_rate",
    "rollout_replica_policy_version",
    "rollout_replica_load",
    "rollout_replica_capacity",
)


class MetricsServerError(RolloutError):
    """The metrics endpoint could not be started (port taken, bad address)."""


class StageMetrics:
    """The metrics of one stage process; see the module docstring for the names."""

    def __init__(self, stage: Stage) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; known: {', '.join(STAGES)}")
        self.stage = stage
        self.registry = CollectorRegistry()
        self._server: WSGIServer | None = None
        r, by_stage = self.registry, ["stage"]
        self._consumed = Counter(
            "rollout_messages_consumed", "Records consumed.", [*by_stage, "topic"], registry=r
        )
        self._produced = Counter(
            "rollout_messages_produced", "Records produced.", [*by_stage, "topic"], registry=r
        )
        # The counters' children by topic: labels() takes a lock and a lookup per call, and
        # the agent-loop worker counts every turn.
        self._consumed_by: dict[str, Any] = {}
        self._produced_by: dict[str, Any] = {}
        self._dead = Counter(
            "rollout_dead_letters", "Records sent to the DLQ.", [*by_stage, "reason"], registry=r
        )
        self._in_flight = Gauge(
            "rollout_in_flight_samples", "Work in progress in this stage.", by_stage, registry=r
        )
        self._verdicts = Counter(
            "rollout_judge_verdicts",
            "Verdicts of the LLM judge, by outcome.",
            [*by_stage, "outcome"],
            registry=r,
        )
        self._version = Gauge(
            "rollout_policy_version",
            "Latest policy version this process knows.",
            by_stage,
            registry=r,
        )
        self._turn = Histogram(
            "rollout_turn_latency_seconds",
            "Seconds per turn.",
            by_stage,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._trajectory = Histogram(
            "rollout_trajectory_latency_seconds",
            "Seconds per trajectory.",
            by_stage,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._staleness = Histogram(
            "rollout_staleness",
            "Policy versions behind, per group or sample.",
            by_stage,
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        # The stage-only children, resolved once: `labels()` takes a lock and checks its
        # arguments on every call, which showed in the reward stage's per-batch profile.
        self._turn_child = self._turn.labels(stage)
        self._trajectory_child = self._trajectory.labels(stage)
        self._staleness_child = self._staleness.labels(stage)

    # --- feeding ----------------------------------------------------------------------

    def consumed(self, topic: str, n: int = 1) -> None:
        child = self._consumed_by.get(topic)
        if child is None:
            child = self._consumed_by[topic] = self._consumed.labels(self.stage, topic)
        child.inc(n)

    def produced(self, topic: str, n: int = 1) -> None:
        child = self._produced_by.get(topic)
        if child is None:
            child = self._produced_by[topic] = self._produced.labels(self.stage, topic)
        child.inc(n)

    def dead_letter(self, reason: str, topic: str | None = None) -> None:
        """One record dead-lettered for `reason` (an error class name); with `topic` (the
        dead-letter topic) it is counted as produced there too."""
        self._dead.labels(self.stage, reason).inc()
        if topic is not None:
            self.produced(topic)

    def judge_verdict(self, outcome: Literal["parsed", "unparseable", "failed"]) -> None:
        """One trajectory judged: a verdict `parsed`, an answer without one (`unparseable`),
        or no answer at all (`failed`)."""
        self._verdicts.labels(self.stage, outcome).inc()

    def observe_turn(self, seconds: float) -> None:
        self._turn_child.observe(max(0.0, seconds))

    def observe_trajectory(self, seconds: float) -> None:
        self._trajectory_child.observe(max(0.0, seconds))

    def observe_staleness(self, versions: int) -> None:
        self._staleness_child.observe(versions)

    def watch(
        self,
        *,
        in_flight: Callable[[], float] | None = None,
        policy_version: Callable[[], float] | None = None,
    ) -> None:
        """Read these gauges from the stage's own state at scrape time (called once)."""
        if in_flight is not None:
            self._in_flight.labels(self.stage).set_function(in_flight)
        if policy_version is not None:
            self._version.labels(self.stage).set_function(policy_version)

    # --- serving ----------------------------------------------------------------------

    def serve(self, port: int | None, host: str = "0.0.0.0") -> int:
        """Serve `/metrics` on `port` from a daemon thread; the port, or 0 when off (0/None)."""
        if not port:
            return 0
        if self._server is not None:
            raise MetricsServerError(f"{self.stage} metrics already served")
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsServerError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        bound = int(self._server.server_port)
        log.info("%s metrics at http://%s:%d/metrics", self.stage, host, bound)
        return bound

    def close(self) -> None:
        """Stop serving (a process that exits need not call this: the thread is a daemon)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class TrainerMetrics(StageMetrics):
    """`StageMetrics("train")` plus the trainer's own families."""

    def __init__(self) -> None:
        super().__init__("train")
        r, by_stage = self.registry, ["stage"]
        self._steps = Counter("rollout_trainer_steps", "Optimiser steps.", by_stage, registry=r)
        self._loss = Gauge("rollout_trainer_loss", "Loss of the last step.", by_stage, registry=r)
        self._reward = Gauge(
            "rollout_trainer_reward_mean",
            "Mean score of the last step's samples.",
            by_stage,
            registry=r,
        )
        self._is_mean = Gauge(
            "rollout_trainer_importance_weight_mean",
            "Mean truncated importance weight of the last step.",
            by_stage,
            registry=r,
        )
        self._is_max = Gauge(
            "rollout_trainer_importance_weight_max",
            "Largest truncated importance weight of the last step.",
            by_stage,
            registry=r,
        )

    def step(self, metrics: Mapping[str, float], reward_mean: float) -> None:
        """One optimiser step with `train_step`'s metrics (`loss`, `is_weight_mean/max`)."""
        self._steps.labels(self.stage).inc()
        self._loss.labels(self.stage).set(metrics["loss"])
        self._reward.labels(self.stage).set(reward_mean)
        self._is_mean.labels(self.stage).set(metrics.get("is_weight_mean", float("nan")))
        self._is_max.labels(self.stage).set(metrics.get("is_weight_max", float("nan")))


@dataclass(frozen=True)
class ReplicaCounters:
    """An engine's live counters, as every backend reads them for `replica_families`."""

    running: float = 0.0
    waiting: float = 0.0
    generated_tokens: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0


def replica_families(
    replica_id: str,
    counters: ReplicaCounters,
    *,
    policy_version: float,
    load: float | None = None,
    capacity: float | None = None,
) -> list[Metric]:
    """The replica contract's `rollout_replica_*{replica}` families, for one scrape.

    Every backend renders these (from its engine's live counters), so the names and the
    derived values (in flight = running + waiting; hit rate = hits / queries, 0 before any
    query) are the same whatever serves the model. `load` is what the replica reports to the
    balancers (`X-Rollout-Load`; default running + waiting), `capacity` the requests it runs at
    once (`X-Rollout-Capacity`; the family is left out when None: unknown).
    """
    labels = [replica_id]
    running, waiting = counters.running, counters.waiting
    queries, hits = counters.prefix_cache_queries, counters.prefix_cache_hits

    def family(kind: type[Metric], name: str, doc: str, value: float) -> Metric:
        fam = kind(name, doc, labels=["replica"])
        fam.add_metric(labels, value)  # type: ignore[attr-defined]
        return fam

    rate = hits / queries if queries else 0.0
    g, c = GaugeMetricFamily, CounterMetricFamily
    families = [
        family(g, "rollout_replica_in_flight", "Requests running or waiting.", running + waiting),
        family(g, "rollout_replica_running_requests", "Requests in the running batch.", running),
        family(g, "rollout_replica_waiting_requests", "Requests queued or paused.", waiting),
        family(c, "rollout_replica_generated_tokens", "Tokens sampled.", counters.generated_tokens),
        family(
            c,
            "rollout_replica_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            queries,
        ),
        family(
            c,
            "rollout_replica_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            hits,
        ),
        family(g, "rollout_replica_prefix_cache_hit_rate", "Hits / queries since start.", rate),
        family(
            g, "rollout_replica_policy_version", "Version of the served weights.", policy_version
        ),
        family(
            g,
            "rollout_replica_load",
            "Running + waiting requests, as reported to balancers.",
            running + waiting if load is None else load,
        ),
    ]
    if capacity is not None:  # unknown: left out, never a made-up 0
        families.append(
            family(g, "rollout_replica_capacity", "Requests the replica runs at once.", capacity)
        )
    return families


class _Snapshot(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render_replica_metrics(
    counters: ReplicaCounters,
    *,
    replica_id: str,
    policy_version: int,
    load: int | None = None,
    capacity: int | None = None,
) -> bytes:
    """`replica_families` as Prometheus text for one scrape, for a backend that serves
    `/metrics` from counters it reads off its engine (the vllm and sglang adapters)."""
    families = replica_families(
        replica_id,
        counters,
        policy_version=float(policy_version),
        load=None if load is None else float(load),
        capacity=None if capacity is None else float(capacity),
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(registry)


def prometheus_totals(text: str) -> dict[str, float]:
    """Prometheus text → each family's samples summed (a counter's `_total` series with it)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        wanted = {family.name, f"{family.name}_total"}
        value = sum(s.value for s in family.samples if s.name in wanted)
        totals[family.name] = totals.get(family.name, 0.0) + value
    return totals
