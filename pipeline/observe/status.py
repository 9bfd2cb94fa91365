"""`rollout status`: what a running pipeline is doing, read from Kafka and the replicas.

Nothing here talks to a stage. From the cluster it reads, for the run's topic prefix:

- every consumer group that has committed offsets on one of the pipeline's topics, with its
  committed position, the topic's end offset and the lag (end − committed) per topic;
- each topic's end offset twice, `interval_s` apart, for its produce rate (messages/s);
- the latest `PolicyVersion` on the (compacted) policy topic;
- the live replicas on the (compacted) replicas topic — tombstoned ones are gone — with their
  role (`policy`, or `judge`: the reward stage's LLM judge), each probed on `/health` for its
  health and the version it serves (a judge's stays where it started: it takes no weights);
- whether the trainer is lent to generation (`trainer.lend`): its replica, `trainer-lent-<port>`,
  is listed while it is lent (`trainer_lent`);
- the number of dead letters, and of the latest `DLQ_SCAN` of them by stage and cause
  (`reward/duplicate_uid`: a uid produced again for another prompt);
- of the newest `SCORED_SCAN` trajectories of each partition of the scored topic, those given
  the failure score, by cause (the `REWARD_FAILURE` header: `unparseable_verdict` for a judge
  answer without a verdict, `scorer_timeout`, ...).
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from kafka import TopicPartition
from kafka.admin import OffsetSpec
from kafka.errors import KafkaError

from schemas.codec import decode
from schemas.errors import DecodeError
from schemas.events import PolicyVersion, ReplicaInfo
from schemas.headers import DLQ_PREFIX, REWARD_FAILURE
from workers.kafka.clients import make_admin, make_consumer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.exceptions import KafkaUnavailableError
from workers.trainer.config import LENT_REPLICA_PREFIX

__all__ = ["DLQ_SCAN", "SCORED_SCAN", "consumer_lag", "pipeline_status", "render_status"]

#: Dead letters read for the count by cause (the newest ones of each partition).
DLQ_SCAN = 10_000
#: Scored trajectories read for the failure-scored count by cause (newest, per partition).
SCORED_SCAN = 2_000


def _partitions(admin: Any, topics: list[str]) -> list[TopicPartition]:
    out = []
    for described in admin.describe_topics(topics):
        for part in described["partitions"]:
            out.append(
                TopicPartition(
                    described["name"], int(part.get("partition_index", part.get("partition", 0)))
                )
            )
    return out


def _offsets(admin: Any, parts: list[TopicPartition], spec: Any) -> dict[TopicPartition, int]:
    answer = admin.list_partition_offsets(dict.fromkeys(parts, spec))
    return {tp: max(int(getattr(info, "offset", info)), 0) for tp, info in answer.items()}


def _compacted(kafka: KafkaConfig, ends: dict[TopicPartition, int]) -> dict[bytes, bytes | None]:
    """Latest value per key of a compacted topic up to `ends` (None for a tombstone)."""
    latest: dict[bytes, bytes | None] = {}

    def keep(record: Any) -> None:
        latest[record.key or b""] = record.value

    _read(kafka, {tp: (0, end) for tp, end in ends.items()}, keep)
    return latest


def _dead_letter_causes(
    kafka: KafkaConfig, ranges: dict[TopicPartition, tuple[int, int]]
) -> dict[str, int]:
    """`stage/cause` → dead letters of that kind among the records of `ranges`."""
    causes: dict[str, int] = {}

    def count(record: Any) -> None:
        own = {k: bytes(v).decode("utf-8", "replace") for k, v in record.headers or []}
        kind = f"{own.get(DLQ_PREFIX + 'stage', '?')}/{own.get(DLQ_PREFIX + 'error.cause', '?')}"
        causes[kind] = causes.get(kind, 0) + 1

    _read(kafka, ranges, count)
    return dict(sorted(causes.items()))


def _failure_causes(
    kafka: KafkaConfig, ranges: dict[TopicPartition, tuple[int, int]]
) -> dict[str, int]:
    """cause → failure-scored trajectories among the scored records of `ranges`."""
    causes: dict[str, int] = {}

    def count(record: Any) -> None:
        for key, value in record.headers or []:
            if key == REWARD_FAILURE:
                cause = bytes(value).decode("utf-8", "replace")
                causes[cause] = causes.get(cause, 0) + 1

    _read(kafka, ranges, count)
    return dict(sorted(causes.items()))


def _read(kafka: KafkaConfig, ranges: dict[TopicPartition, tuple[int, int]], each: Any) -> None:
    """Call `each(record)` for every record of `[start, end)` of each partition.

    The partitions are assigned by hand, not subscribed: a subscription is only assigned
    inside a poll, and a first poll that returns before the metadata arrives (a loaded
    machine) read as an empty topic.
    """
    ranges = {tp: (start, end) for tp, (start, end) in ranges.items() if end > start}
    if not ranges:
        return
    topics = sorted({tp.topic for tp in ranges})
    consumer = make_consumer(kafka, group_id=None, name="status")
    deadline = time.monotonic() + 30

    def behind(tp: TopicPartition, end: int) -> bool:
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        position = consumer.position(tp, timeout_ms=left_ms)  # None: its reset is still on
        return position is None or position < end

    try:
        consumer.assign(list(ranges))
        for tp, (start, _end) in ranges.items():
            consumer.seek(tp, start)
        while any(behind(tp, end) for tp, (_start, end) in ranges.items()):
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(f"reading {topics} to its end took over 30 s")
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    if record.offset < ranges[TopicPartition(record.topic, record.partition)][1]:
                        each(record)
    except KafkaError as exc:
        raise KafkaUnavailableError(f"reading {topics}: {exc}") from exc
    finally:
        consumer.close()


def _group_id(listed: Any) -> str:
    # kafka-python 3 lists groups as dicts; older releases as (group_id, protocol) tuples.
    if isinstance(listed, dict):
        return str(listed["group_id"])
    if isinstance(listed, tuple):
        return str(listed[0])
    return str(getattr(listed, "group_id", listed))


def _health(address: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/health", timeout=2) as resp:
            body = json.loads(resp.read())
            return {"healthy": body.get("status") == "ok", "version": body.get("version")}
    except (OSError, ValueError):
        return {"healthy": False, "version": None}


def _group_lags(
    committed: dict[Any, Any],
    ends: dict[TopicPartition, int],
    names: set[str],
    starts: dict[TopicPartition, int] | None = None,
) -> dict[str, dict[str, dict[str, int]]]:
    """group → topic → committed, end and lag (end − committed), summed over partitions.

    A partition of a topic the group reads but has not committed on yet counts from its start
    (the group reads it from the earliest offset): its records are lag too, not nothing."""
    starts = starts or {}
    groups: dict[str, dict[str, dict[str, int]]] = {}
    for group, offsets in committed.items():
        positions = {
            tp: int(meta.offset)
            for tp, meta in (offsets or {}).items()
            if tp.topic in names and int(meta.offset) >= 0
        }
        for tp in ends:
            if tp not in positions and any(tp.topic == seen.topic for seen in positions):
                positions[tp] = starts.get(tp, 0)
        for tp, offset in positions.items():
            entry = groups.setdefault(str(group), {}).setdefault(
                tp.topic, {"committed": 0, "end": 0, "lag": 0}
            )
            entry["committed"] += offset
            entry["end"] += ends.get(tp, 0)
            entry["lag"] += max(ends.get(tp, 0) - offset, 0)
    return groups


def consumer_lag(kafka: KafkaConfig, topics: TopicsConfig) -> dict[str, dict[str, dict[str, int]]]:
    """Only the consumer groups' lag (group → topic → committed, end, lag), in one pass."""
    admin = make_admin(kafka)
    try:
        names = sorted(set(topics.all_names().values()) & set(admin.list_topics()))
        parts = _partitions(admin, names)
        ends = _offsets(admin, parts, OffsetSpec.LATEST)
        starts = _offsets(admin, parts, OffsetSpec.EARLIEST)
        group_ids = [_group_id(g) for g in admin.list_groups()]
        committed = admin.list_group_offsets({str(g): None for g in group_ids}) if group_ids else {}
    finally:
        admin.close()
    return _group_lags(committed, ends, set(names), starts)


def pipeline_status(
    kafka: KafkaConfig, topics: TopicsConfig, *, interval_s: float = 2.0
) -> dict[str, Any]:
    admin = make_admin(kafka)
    try:
        names = sorted(set(topics.all_names().values()) & set(admin.list_topics()))
        parts = _partitions(admin, names)
        first = _offsets(admin, parts, OffsetSpec.LATEST)
        started = time.monotonic()
        time.sleep(interval_s)
        ends = _offsets(admin, parts, OffsetSpec.LATEST)
        elapsed = time.monotonic() - started
        starts = _offsets(admin, parts, OffsetSpec.EARLIEST)
        earliest = {tp: v for tp, v in starts.items() if tp.topic == topics.name("dlq")}

        group_ids = [_group_id(g) for g in admin.list_groups()]
        committed = admin.list_group_offsets({str(g): None for g in group_ids}) if group_ids else {}
    finally:
        admin.close()

    by_topic = {name: sum(v for tp, v in ends.items() if tp.topic == name) for name in names}
    rates = {
        name: round(
            sum(ends[tp] - first.get(tp, 0) for tp in ends if tp.topic == name) / elapsed, 2
        )
        for name in names
    }
    groups = _group_lags(committed, ends, set(by_topic), starts)

    def latest(topic: str) -> dict[bytes, bytes | None]:
        return _compacted(kafka, {tp: end for tp, end in ends.items() if tp.topic == topic})

    version: int | None = None
    for value in latest(topics.name("policy")).values():
        try:
            event = decode(value) if value is not None else None
        except DecodeError:
            continue
        if isinstance(event, PolicyVersion):
            version = max(version or 0, event.version)
    replicas = []
    for _key, value in sorted(latest(topics.name("replicas")).items()):
        if value is None:
            continue  # left cleanly (tombstone)
        try:
            info = decode(value)
        except DecodeError:
            continue
        if isinstance(info, ReplicaInfo):
            replicas.append(
                {
                    "replica_id": info.replica_id,
                    "address": info.address,
                    "backend": info.backend,
                    "role": info.role,
                    "lent": info.replica_id.startswith(LENT_REPLICA_PREFIX),  # trainer.lend
                    **_health(info.address),
                }
            )
    scored = topics.name("scored")
    newest_scored = {
        tp: (max(starts.get(tp, 0), end - SCORED_SCAN), end)
        for tp, end in ends.items()
        if tp.topic == scored
    }
    dlq = topics.name("dlq")
    dead = {
        tp: (max(earliest.get(tp, 0), end - DLQ_SCAN), end)
        for tp, end in ends.items()
        if tp.topic == dlq
    }
    return {
        "bootstrap": kafka.bootstrap,
        "prefix": topics.prefix,
        "groups": groups,
        "topics": {
            name: {"end_offset": by_topic[name], "messages_per_s": rates[name]} for name in names
        },
        "policy_version": version,
        "replicas": replicas,
        "trainer_lent": any(r["lent"] for r in replicas),
        "dlq_count": sum(v for tp, v in ends.items() if tp.topic == dlq) - sum(earliest.values()),
        "dlq_causes": _dead_letter_causes(kafka, dead),
        "reward_failures": _failure_causes(kafka, newest_scored),
    }


def render_status(status: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table

    lag = Table(title=f"consumer groups on {status['prefix']}* at {status['bootstrap']}")
    for column in ("group", "topic", "committed", "end", "lag"):
        lag.add_column(column, justify="right" if column in ("committed", "end", "lag") else "left")
    for group, topics in sorted(status["groups"].items()):
        for topic, row in sorted(topics.items()):
            lag.add_row(group, topic, str(row["committed"]), str(row["end"]), str(row["lag"]))
    rates = Table(title="topics")
    for column in ("topic", "end offset", "messages/s"):
        rates.add_column(column)
    for topic, row in status["topics"].items():
        rates.add_row(topic, str(row["end_offset"]), f"{row['messages_per_s']:.1f}")
    reps = Table(
        title=f"replicas (policy version {status['policy_version']}, "
        f"dead letters {status['dlq_count']}"
        f"{', trainer lent to generation' if status.get('trainer_lent') else ''})"
    )
    for column in ("replica", "role", "address", "backend", "healthy", "version"):
        reps.add_column(column)
    for rep in status["replicas"]:
        reps.add_row(
            rep["replica_id"],
            rep["role"],
            rep["address"],
            rep["backend"],
            str(rep["healthy"]),
            str(rep["version"]),
        )
    causes = Table(title="dead letters by stage/cause (the newest)")
    for column in ("stage/cause", "count"):
        causes.add_column(column)
    for kind, count in status.get("dlq_causes", {}).items():
        causes.add_row(kind, str(count))
    failures = Table(title="failure-scored trajectories by cause (the newest)")
    for column in ("cause", "count"):
        failures.add_column(column)
    for cause, count in status.get("reward_failures", {}).items():
        failures.add_row(cause, str(count))
    return Group(lag, rates, reps, causes, failures)
