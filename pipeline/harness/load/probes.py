"""What the soak reads from the running pipeline: RSS of process trees (from /proc), the
stages' Prometheus counters, and the timestamps that give end-to-end latency.

End-to-end latency is exact to the broker's millisecond timestamps: for every trajectory on
the scored topic, its record's CreateTime (stamped by the reward stage's producer when it
sent the `ScoredTrajectory`) minus the CreateTime of its prompt's record on the prompts topic
(stamped by the load driver's producer when it sent the `PromptEvent`), joined by uid (the
key of both). The first record of each trajectory id counts (a redelivery does not).
Both producers run on this machine, so one clock stamps both.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from kafka import TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from schemas.headers import TRAJECTORY_ID
from workers.kafka.clients import make_consumer
from workers.kafka.config import KafkaConfig

__all__ = ["counters", "read_timestamps", "tree_rss"]

PAGE = os.sysconf("SC_PAGE_SIZE")
COUNTERS = {
    "rollout_messages_consumed_total": "consumed",
    "rollout_messages_produced_total": "produced",
}


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name may hold spaces and parentheses: fields start after the last ")".
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(roots: dict[str, int]) -> dict[str, int]:
    """name → resident bytes of the process `roots[name]` and all its descendants (0 when
    it is gone). Shared pages count once per process, as `ps` counts them."""
    children = _children()
    out: dict[str, int] = {}
    for name, root in roots.items():
        total, stack = 0, [root]
        while stack:
            pid = stack.pop()
            total += _rss(pid)
            stack.extend(children.get(pid, ()))
        out[name] = total
    return out


def counters(urls: Iterable[str], timeout_s: float = 2.0) -> dict[tuple[str, str, str], float]:
    """(stage, topic, "consumed" | "produced") → value, summed over the processes at `urls`
    (their `/metrics`); a process that does not answer yet contributes nothing."""
    out: dict[tuple[str, str, str], float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                direction = COUNTERS.get(sample.name)
                if direction is None:
                    continue
                key = (sample.labels["stage"], sample.labels["topic"], direction)
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def read_timestamps(kafka: KafkaConfig, topic: str, *, by_header: bool = False) -> dict[str, float]:
    """Every record of `topic` up to its current end: key (or, with `by_header`, the
    trajectory id header) → CreateTime in seconds, the first record of each."""
    consumer = make_consumer(kafka, group_id=None, name="load-latency")
    stamps: dict[str, float] = {}
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            for records in consumer.poll(timeout_ms=1000, max_records=5000).values():
                for record in records:
                    key = record.key.decode() if record.key is not None else ""
                    if by_header:
                        found = (v for k, v in record.headers or () if k == TRAJECTORY_ID)
                        key = next((v.decode() for v in found), key)
                    stamps.setdefault(key, record.timestamp / 1000.0)
    finally:
        consumer.close()
    return stamps
