"""`rollout status`'s consumer lag: what a group has still to read, per topic."""

from __future__ import annotations

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from pipeline.observe.status import _group_lags


def test_partitions_without_a_commit_count_from_their_start() -> None:
    tp0, tp1, tp2 = (TopicPartition("p", i) for i in range(3))
    other = TopicPartition("q", 0)
    ends = {tp0: 3, tp1: 3, tp2: 2, other: 5}
    committed = {"g": {tp0: OffsetAndMetadata(3, "3", -1)}}  # read all of partition 0 only
    lags = _group_lags(committed, ends, {"p", "q"}, {tp2: 1})
    # Partition 0 is done; 1 and 2 were never committed: 3 records and 1 (its log starts at 1).
    assert lags == {"g": {"p": {"committed": 4, "end": 8, "lag": 4}}}  # and nothing of "q"


def test_the_table_says_when_the_trainer_is_lent_to_generation() -> None:
    from rich.console import Console

    from pipeline.observe.status import render_status

    replica = {
        "replica_id": "trainer-lent-4242",
        "role": "policy",
        "address": "http://127.0.0.1:4242",
        "backend": "hf",
        "healthy": True,
        "version": 3,
        "lent": True,
    }
    base = {"prefix": "rl.", "bootstrap": "b:9092", "groups": {}, "topics": {}}
    base |= {"policy_version": 3, "dlq_count": 0}

    def shown(status: dict) -> str:
        console = Console(width=200, record=True, file=None)
        console.print(render_status(status))
        return console.export_text()

    assert "trainer lent to generation" in shown(
        base | {"replicas": [replica], "trainer_lent": True}
    )
    assert "trainer lent" not in shown(base | {"replicas": [], "trainer_lent": False})
