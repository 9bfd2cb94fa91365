"""The pure parts of the local cluster: what `up --brokers 3` records, how `status` and
`down` find it again from any member's port, and each node's rendered config."""

from __future__ import annotations

import pytest

from pipeline.broker import cluster
from pipeline.broker.cluster import ClusterState, find_cluster


@pytest.fixture
def state(tmp_path, monkeypatch) -> ClusterState:
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    recorded = ClusterState(
        port=9092,
        ports=[9092, 9093, 9094],
        controller_ports=[40001, 40002, 40003],
        data_dir=str(tmp_path / "data"),
        cluster_id="dtNRICRiQPG44HVwezwIdg",
        heap="512m",
        started_at=0.0,
    )
    recorded.save()
    return recorded


def test_the_cluster_is_found_from_any_members_port(state: ClusterState) -> None:
    assert find_cluster(9092) == state
    assert find_cluster(9094) == state
    assert find_cluster(9095) is None
    assert state.bootstrap == "localhost:9092,localhost:9093,localhost:9094"
    assert state.nodes == [1, 2, 3] and state.port_of(2) == 9093


def test_each_node_is_a_voter_of_one_quorum_with_production_replication(
    state: ClusterState,
) -> None:
    props = cluster._render(state, 2).read_text()
    assert "node.id=2\n" in props
    voters = "controller.quorum.voters=1@localhost:40001,2@localhost:40002,3@localhost:40003"
    assert voters in props
    assert "listeners=PLAINTEXT://127.0.0.1:9093,CONTROLLER://127.0.0.1:40002" in props
    for line in (
        "offsets.topic.replication.factor=3",
        "transaction.state.log.min.isr=2",
        "min.insync.replicas=2",
        "unclean.leader.election.enable=false",
        f"broker.session.timeout.ms={cluster.BROKER_SESSION_TIMEOUT_MS}",
    ):
        assert f"{line}\n" in props
    assert str(state.node_dir(2) / "logs") in props


def test_a_cluster_has_three_brokers_at_least(tmp_path, monkeypatch) -> None:
    from workers.kafka.exceptions import KafkaUnavailableError

    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path))
    with pytest.raises(KafkaUnavailableError, match="at least 3"):
        cluster.start_cluster(9092, brokers=2)
