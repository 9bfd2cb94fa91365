"""The pure parts of a newcomer's first contact: client log routing, the bootstrap timeout,
and when `rollout produce` may create the run's topics itself."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pipeline.topics import creates_missing
from workers.kafka.client_logs import CLIENT_LOGGERS, route_client_logs
from workers.kafka.clients import connection_kwargs
from workers.kafka.config import KafkaConfig, TopicsConfig


@pytest.fixture
def client_levels() -> Iterator[None]:
    saved = {name: logging.getLogger(name).level for name in CLIENT_LOGGERS}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def test_client_records_pass_only_when_verbose(client_levels) -> None:
    route_client_logs(0)
    for name in ("kafka.net.manager", "kafka.cluster", "aiokafka.conn"):
        assert not logging.getLogger(name).isEnabledFor(logging.ERROR), name
    assert logging.getLogger("rollout.topics").isEnabledFor(logging.WARNING)
    route_client_logs(1)
    assert logging.getLogger("kafka.net.manager").isEnabledFor(logging.WARNING)


def test_every_client_gets_the_bootstrap_timeout() -> None:
    assert connection_kwargs(KafkaConfig())["bootstrap_timeout_ms"] == 5_000
    assert connection_kwargs(KafkaConfig(bootstrap_timeout_ms=800))["bootstrap_timeout_ms"] == 800


@pytest.mark.parametrize(
    ("servers", "mode", "creates"),
    [
        (["localhost:9092"], "local", True),
        (["127.0.0.1:9092", "[::1]:9093"], "local", True),
        (["localhost:9092", "kafka-1:9092"], "local", False),
        (["kafka-1:9092"], "local", False),
        (["kafka-1:9092"], "always", True),
        (["localhost:9092"], "never", False),
    ],
)
def test_produce_creates_missing_topics_on_a_local_broker_only(servers, mode, creates) -> None:
    kafka = KafkaConfig(bootstrap_servers=servers)
    assert creates_missing(kafka, TopicsConfig(create_missing=mode)) is creates
