"""`pipeline_status` against the real broker: the compacted policy and replicas topics."""

from __future__ import annotations

import pytest

from pipeline.observe.status import pipeline_status
from schemas import encode
from schemas.events import PolicyVersion, ReplicaInfo
from schemas.headers import REWARD_FAILURE
from workers.kafka.clients import make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = pytest.mark.kafka


def test_status_reads_the_newest_version_and_the_live_replicas(
    kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    empty = pipeline_status(kafka_config, topics_config, interval_s=0.1)
    assert empty["policy_version"] is None and empty["replicas"] == []

    policy, replicas = topics_config.name("policy"), topics_config.name("replicas")
    producer = make_producer(kafka_config)
    try:
        for version in (1, 2, 3):
            producer.send(
                policy,
                key="policy",
                value=encode(PolicyVersion(version=version, path=f"/ckpt/{version}")),
            )
        for i in range(3):
            info = ReplicaInfo(replica_id=f"r{i}", address=f"http://127.0.0.1:9/{i}", backend="hf")
            producer.send(replicas, key=info.replica_id, value=encode(info))
        producer.send(replicas, key="r1", value=None)  # r1 left cleanly
        producer.flush(timeout=30)
    finally:
        producer.close()

    seen = pipeline_status(kafka_config, topics_config, interval_s=0.1)
    assert seen["policy_version"] == 3
    assert [(r["replica_id"], r["healthy"]) for r in seen["replicas"]] == [
        ("r0", False),
        ("r2", False),
    ]


def test_status_shows_replica_roles_and_failure_scored_trajectories_by_cause(
    kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    replicas, scored = topics_config.name("replicas"), topics_config.name("scored")
    producer = make_producer(kafka_config)
    try:
        for rid, role in (("policy-0", "policy"), ("judge-0", "judge")):
            info = ReplicaInfo(
                replica_id=rid, address="http://127.0.0.1:9", backend="hf", role=role
            )
            producer.send(replicas, key=rid, value=encode(info))
        # The header is what counts (the values are not decoded for it).
        causes = ["unparseable_verdict", "unparseable_verdict", "scorer_timeout", None]
        for i, cause in enumerate(causes):
            headers = [(REWARD_FAILURE, cause.encode())] if cause else []
            producer.send(scored, key=f"u{i}", value=b"{}", headers=headers)
        producer.flush(timeout=30)
    finally:
        producer.close()

    seen = pipeline_status(kafka_config, topics_config, interval_s=0.1)
    assert {r["replica_id"]: r["role"] for r in seen["replicas"]} == {
        "judge-0": "judge",
        "policy-0": "policy",
    }
    assert seen["reward_failures"] == {"scorer_timeout": 1, "unparseable_verdict": 2}
