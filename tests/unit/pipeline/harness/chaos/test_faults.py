"""The chaos suite's fault names, and which a run may fire."""

from __future__ import annotations

import pytest

from pipeline.cli.chaos import _faults
from pipeline.config import ConfigError
from pipeline.harness.chaos.faults import (
    CLUSTER_FAULTS,
    DEFAULT_FAULTS,
    Fault,
    parse_fault,
    schedule,
)


def test_broker_faults_of_a_cluster_are_told_from_the_stages_faults() -> None:
    assert parse_fault("kill:broker") == Fault("kill", "broker")
    assert parse_fault("stop:broker-2").on_cluster
    assert parse_fault("bounce:brokers").on_cluster
    assert not parse_fault("kill:reward").on_cluster
    assert not parse_fault("broker").on_cluster  # the one broker's restart
    for bad in ("bounce:reward", "kill:brokers", "term:broker", "stop:broker-x", "bounce:broker"):
        with pytest.raises(ValueError, match="bad fault"):
            parse_fault(bad)


def test_the_cluster_default_keeps_every_stage_fault_and_adds_the_broker_faults() -> None:
    assert set(CLUSTER_FAULTS) == (set(DEFAULT_FAULTS) - {"broker"}) | {
        "kill:broker",
        "stop:broker",
        "bounce:brokers",
    }
    planned = schedule(CLUSTER_FAULTS, seed=1)
    assert sorted(f.name for f in planned) == sorted(CLUSTER_FAULTS)
    assert [f.trigger for f in planned] == sorted(f.trigger for f in planned)


def test_a_run_refuses_faults_its_kafka_cannot_take_in_one_line() -> None:
    assert _faults(None, existing=None) == DEFAULT_FAULTS
    assert _faults(None, existing=None, brokers=3) == CLUSTER_FAULTS
    with pytest.raises(ConfigError, match="--brokers 3"):
        _faults(["kill:broker"], existing=None)
    with pytest.raises(ConfigError, match="kill:broker"):
        _faults(["broker"], existing=None, brokers=3)
    with pytest.raises(ConfigError, match="--brokers"):
        _faults(None, existing=None, brokers=2)
    with pytest.raises(ConfigError, match="own cluster"):
        _faults(None, existing="localhost:9092", brokers=3)
