"""`workers.metrics`: the fixed names and labels, served over HTTP in Prometheus text format."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeline.cli.main import build_parser
from pipeline.launch.local import StagePlan
from workers.metrics import (
    NAMES,
    MetricsServerError,
    ReplicaCounters,
    StageMetrics,
    TrainerMetrics,
    replica_families,
)
from workers.ports import free_port


def _scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, [s for s in samples if s.name == name])
    return found[0]


@pytest.fixture
def served() -> Iterator[tuple[StageMetrics, int]]:
    metrics = StageMetrics("reward")
    port = metrics.serve(free_port(), host="127.0.0.1")
    try:
        yield metrics, port
    finally:
        metrics.close()


def test_stage_families_have_the_fixed_names_and_labels(
    served: tuple[StageMetrics, int],
) -> None:
    metrics, port = served
    held = [3]
    metrics.consumed("rl.turns", 4)
    metrics.produced("rl.scored")
    metrics.dead_letter("DecodeError", topic="rl.dlq")
    metrics.observe_turn(0.2)
    metrics.observe_trajectory(1.5)
    metrics.observe_trajectory(-1.0)  # clock skew between hosts: counted as 0
    metrics.observe_staleness(2)
    metrics.observe_staleness(11)
    metrics.watch(in_flight=lambda: held[0], policy_version=lambda: 7)
    held[0] = 5  # read at scrape time, not when watched

    samples = _scrape(port)
    stage = {"stage": "reward"}
    assert _value(samples, "rollout_messages_consumed_total", **stage, topic="rl.turns") == 4
    assert _value(samples, "rollout_messages_produced_total", **stage, topic="rl.scored") == 1
    assert _value(samples, "rollout_messages_produced_total", **stage, topic="rl.dlq") == 1
    assert _value(samples, "rollout_dead_letters_total", **stage, reason="DecodeError") == 1
    assert _value(samples, "rollout_in_flight_samples", **stage) == 5
    assert _value(samples, "rollout_policy_version", **stage) == 7
    assert _value(samples, "rollout_turn_latency_seconds_count", **stage) == 1
    assert _value(samples, "rollout_trajectory_latency_seconds_count", **stage) == 2
    assert _value(samples, "rollout_trajectory_latency_seconds_bucket", **stage, le="0.05") == 1
    assert _value(samples, "rollout_trajectory_latency_seconds_sum", **stage) == 1.5
    buckets = {s.labels["le"]: s.value for s in samples if s.name == "rollout_staleness_bucket"}
    assert buckets == {
        **{f"{v}.0": (0.0 if v < 2 else 1.0) for v in range(9)},
        "+Inf": 2.0,
    }
    # Every stage sample carries `stage` (and nothing but the fixed extra label).
    families = {
        "rollout_messages_consumed": {"stage", "topic"},
        "rollout_messages_produced": {"stage", "topic"},
        "rollout_dead_letters": {"stage", "reason"},
    }
    for s in samples:
        if not s.name.startswith("rollout_"):
            continue
        base = s.name.removesuffix("_total").removesuffix("_created")
        expected = families.get(base, {"stage"})
        assert set(s.labels) - {"le"} == expected, s
        assert s.labels["stage"] == "reward"


def test_trainer_families_carry_stage_train() -> None:
    metrics = TrainerMetrics()
    port = metrics.serve(free_port(), host="127.0.0.1")
    try:
        metrics.step({"loss": 0.25, "is_weight_mean": 0.9, "is_weight_max": 2.0}, 0.4)
        metrics.step({"loss": 0.125, "is_weight_mean": 1.0, "is_weight_max": 1.5}, 0.5)
        metrics.observe_staleness(1)
        samples = _scrape(port)
    finally:
        metrics.close()
    train = {"stage": "train"}
    assert _value(samples, "rollout_trainer_steps_total", **train) == 2
    assert _value(samples, "rollout_trainer_loss", **train) == 0.125
    assert _value(samples, "rollout_trainer_reward_mean", **train) == 0.5
    assert _value(samples, "rollout_trainer_importance_weight_mean", **train) == 1.0
    assert _value(samples, "rollout_trainer_importance_weight_max", **train) == 1.5
    assert _value(samples, "rollout_staleness_count", **train) == 1


def test_every_name_in_the_contract_is_rendered_somewhere() -> None:
    stage = StageMetrics("agent-loop")
    stage.consumed("t")
    stage.produced("t")
    stage.dead_letter("E")
    stage.observe_turn(1)
    stage.observe_trajectory(1)
    stage.observe_staleness(0)
    stage.judge_verdict("parsed")
    stage.watch(in_flight=lambda: 0, policy_version=lambda: 0)
    trainer = TrainerMetrics()
    trainer.step({"loss": 0.0, "is_weight_mean": 1.0, "is_weight_max": 1.0}, 0.0)
    families = [*stage.registry.collect(), *trainer.registry.collect()]
    families += replica_families("r0", ReplicaCounters(), policy_version=0, capacity=1)
    rendered = {
        s.name
        for fam in families
        for s in fam.samples
        if not s.name.endswith(("_created", "_bucket", "_sum"))
    }
    rendered = {n.removesuffix("_count") for n in rendered}
    assert set(NAMES) <= rendered, set(NAMES) - rendered


def test_replica_families_derive_in_flight_and_hit_rate() -> None:
    def values(
        load: float | None = None, capacity: float | None = None, **counts: float
    ) -> dict[str, float]:
        counters = ReplicaCounters(generated_tokens=9.0, **counts)
        fams = replica_families("r1", counters, policy_version=3.0, load=load, capacity=capacity)
        assert all(s.labels == {"replica": "r1"} for fam in fams for s in fam.samples)
        return {s.name: s.value for fam in fams for s in fam.samples}

    v = values(running=2, waiting=3, prefix_cache_queries=200, prefix_cache_hits=50)
    assert v["rollout_replica_in_flight"] == 5
    assert v["rollout_replica_load"] == 5  # what the balancers see, running + waiting by default
    assert "rollout_replica_capacity" not in v  # unknown: left out, never a made-up 0
    told = values(running=2, waiting=3, load=7, capacity=16)
    assert (told["rollout_replica_load"], told["rollout_replica_capacity"]) == (7, 16)
    assert v["rollout_replica_prefix_cache_hit_rate"] == 0.25
    assert v["rollout_replica_prefix_cache_queries_total"] == 200
    assert v["rollout_replica_prefix_cache_hits_total"] == 50
    assert v["rollout_replica_generated_tokens_total"] == 9
    cold = values()
    assert cold["rollout_replica_prefix_cache_hit_rate"] == 0.0


def test_registries_are_per_object_and_serving_is_optional() -> None:
    a, b = StageMetrics("replay"), StageMetrics("replay")  # same names, no clash
    a.consumed("x")
    assert (
        b.registry.get_sample_value(
            "rollout_messages_consumed_total", {"stage": "replay", "topic": "x"}
        )
        is None
    )
    assert a.serve(0) == 0 and a.serve(None) == 0
    with pytest.raises(ValueError, match="unknown stage"):
        StageMetrics("nope")  # type: ignore[arg-type]


def test_a_taken_port_is_a_rollout_error(served: tuple[StageMetrics, int]) -> None:
    _, port = served
    with pytest.raises(MetricsServerError, match=str(port)):
        StageMetrics("sync").serve(port, host="127.0.0.1")


def test_stage_plan_adds_metrics_ports_that_the_cli_accepts() -> None:
    ports = {"sync-0": 9101, "agent-loop": 9102, "reward": 9103, "replay": 9104, "train": 9105}
    plan = dict(StagePlan(model_dir="/m").processes([8001], ports))
    assert "--metrics-port" not in plan["replica-0"]
    parser = build_parser()
    for name, port in ports.items():
        assert plan[name][-2:] == ["--metrics-port", str(port)]
        assert parser.parse_args(plan[name]).metrics_port == port
    assert parser.parse_args(["worker", "reward"]).metrics_port == 0
    with pytest.raises(ValueError, match="replica-0"):
        StagePlan(model_dir="/m").processes([8001], {"replica-0": 1})
