"""Who leads what on a cluster, and what is in sync: `partition_leaders`, `under_replicated`,
`wait_in_sync`, `coordinator_of`.

Read from the cluster's metadata through an admin client; a node that died a moment ago may
still be in the metadata the client holds, so each question is asked again for a while
(`workers.kafka.retry`) before `KafkaUnavailableError` says the cluster does not answer. Used
by `rollout kafka status`, the chaos suite's broker faults (which broker leads the most
partitions of `rl.turns`; a rolling restart waits for every replica to be back in sync) and the
failover tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from workers.kafka.config import KafkaConfig
from workers.kafka.exceptions import KafkaUnavailableError

__all__ = ["coordinator_of", "partition_leaders", "under_replicated", "wait_in_sync"]


def partition_leaders(
    kafka: KafkaConfig, topics: Iterable[str] | None = None
) -> dict[int, dict[str, list[int]]]:
    """node id → topic → partitions it leads (of `topics`, default every topic but the
    internal ones)."""
    out: dict[int, dict[str, list[int]]] = {}
    for topic, partition, leader, _replicas, _isr in _partitions(kafka, topics):
        if leader >= 0:
            out.setdefault(leader, {}).setdefault(topic, []).append(partition)
    for by_topic in out.values():
        for parts in by_topic.values():
            parts.sort()
    return out


def under_replicated(kafka: KafkaConfig, topics: Iterable[str] | None = None) -> int:
    """Partitions (internal ones too) whose in-sync replicas are fewer than their replicas."""
    return sum(
        1
        for *_, replicas, isr in _partitions(kafka, topics, internal=True)
        if len(isr) < len(replicas)
    )


def wait_in_sync(kafka: KafkaConfig, timeout_s: float = 120.0) -> float:
    """Wait until no partition is under-replicated (a returned broker caught up); seconds
    waited. `TimeoutError` past `timeout_s`."""
    started = time.monotonic()
    while True:
        try:
            if under_replicated(kafka) == 0:
                return time.monotonic() - started
        except KafkaUnavailableError:
            pass
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"partitions still under-replicated after {timeout_s:.0f}s")
        time.sleep(0.5)


def coordinator_of(kafka: KafkaConfig, group: str) -> int:
    """The node id of the broker coordinating consumer group `group` now."""
    from kafka.errors import KafkaError

    from workers.kafka.clients import make_admin
    from workers.kafka.retry import call_retrying

    def ask() -> int:
        admin = make_admin(kafka, name="coordinator")
        try:
            return int(admin._manager.run(admin._find_coordinator_id, group))
        finally:
            admin.close()

    try:
        return call_retrying(ask, f"coordinator of {group}", 30.0)
    except (KafkaError, OSError) as exc:
        raise KafkaUnavailableError(f"cluster at {kafka.bootstrap}: {exc}") from exc


def _partitions(
    kafka: KafkaConfig, topics: Iterable[str] | None, *, internal: bool = False
) -> list[tuple[str, int, int, list[int], list[int]]]:
    """(topic, partition, leader, replicas, in-sync replicas) of every partition of `topics`;
    asked again for a while when a node it asks has just died."""
    from kafka.errors import KafkaError

    from workers.kafka.retry import call_retrying

    try:
        return call_retrying(lambda: _describe(kafka, topics, internal), "partitions", 30.0)
    except (KafkaError, OSError) as exc:
        raise KafkaUnavailableError(f"cluster at {kafka.bootstrap}: {exc}") from exc


def _describe(
    kafka: KafkaConfig, topics: Iterable[str] | None, internal: bool
) -> list[tuple[str, int, int, list[int], list[int]]]:
    from workers.kafka.clients import make_admin

    admin = make_admin(kafka, name="cluster-status")
    try:
        names = list(topics) if topics is not None else admin.list_topics()
        if internal and topics is None:
            names.append("__consumer_offsets")
        names = [n for n in names if internal or not n.startswith("__")]
        rows = []
        for entry in admin.describe_topics(names) if names else []:
            if entry.get("error_code", 0):
                continue
            for part in entry.get("partitions", []):
                rows.append(
                    (
                        str(entry["name"]),
                        int(part["partition_index"]),
                        int(part["leader_id"]),
                        list(part["replica_nodes"]),
                        list(part["isr_nodes"]),
                    )
                )
        return rows
    finally:
        admin.close()
