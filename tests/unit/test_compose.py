"""docker-compose.yml cannot run here (no image registry): keep it correct by reading it."""

from __future__ import annotations

from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def test_kafka_service_is_a_kraft_single_node() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] == "CONTROLLER"
    node = env["KAFKA_NODE_ID"]
    voter_id, _, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].partition("@")
    assert int(voter_id) == node
    # Every listener named is mapped to a protocol, and the controller's port is a listener.
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    listeners = {
        item.split("://")[0]: item.split(":")[-1] for item in env["KAFKA_LISTENERS"].split(",")
    }
    assert set(listeners) <= set(protocols)
    assert listeners["CONTROLLER"] == voter.split(":")[1]
    for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","):
        assert item.split("://")[0] in listeners
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in listeners
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == 1
    published = [p.split(":")[0] for p in kafka["ports"]]
    assert "9092" in published
