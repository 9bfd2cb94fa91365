"""The live view of a local run (`rollout up`, the demo): one line per stage, read from Kafka,
the replicas and the step log.

`Progress(kafka, stages, replica_urls, metrics_path)` polls, without touching any stage:

- produced: the end offset (sum over partitions) of the topic each stage writes;
- consumed: the offsets the stage's consumer group has committed on its input topic;
- lag: input end offset − committed (what waits for the stage);
- in flight: what the stage has taken but not yet passed on — generations running or
  queued on the replicas (agent loop), committed turns not yet scored (reward, single-turn
  trajectories), committed samples not yet in a group (replay, ÷ n); the trainer's
  half-collected batch is not visible from outside (shown as "-");
- trainer: step / max steps, the last step's reward mean (and over the last 5 steps), its
  mean staleness, groups dropped as stale, the policy version published and the version
  each replica serves (`/info`).

Offsets come from kafka-python's admin client (`list_group_offsets`,
`list_partition_offsets`). Committed offsets move at each stage's commit interval, so the
numbers trail reality by a second or two. `render()` turns a snapshot into a rich table.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka.errors import KafkaError

from workers.kafka.clients import make_admin
from workers.kafka.config import KafkaConfig

__all__ = ["Progress", "Snapshot", "StageSpec", "render"]

log = logging.getLogger("rollout.demo")


@dataclass(frozen=True)
class StageSpec:
    """A stage as the view sees it: its consumer group, input topic and output topics."""

    name: str
    group: str
    source: str
    sinks: tuple[str, ...]
    per_output: int = 1  # input records per output record (replay: n samples → one group)


@dataclass
class Snapshot:
    """One poll's numbers (`stages[name]` holds consumed / produced / lag / in_flight)."""

    stages: dict[str, dict[str, int | None]] = field(default_factory=dict)
    step: int = 0
    reward: float | None = None
    reward_recent: float | None = None
    stale_dropped: int = 0
    staleness: float | None = None
    policy_version: int = 0
    replica_versions: list[int | None] = field(default_factory=list)
    running: int = 0
    steps: list[dict[str, Any]] = field(default_factory=list)


class Progress:
    """Polls the numbers of the module docstring; `poll()` never raises on a Kafka hiccup."""

    def __init__(
        self,
        kafka: KafkaConfig,
        stages: list[StageSpec],
        replica_urls: list[str],
        metrics_path: str | Path,
    ) -> None:
        self.kafka, self.stages, self.replica_urls = kafka, stages, replica_urls
        self.metrics_path = Path(metrics_path)
        self._admin: Any = None
        self._partitions: dict[str, list[Any]] = {}
        self._read = 0
        self.last = Snapshot()

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def _topic_partitions(self, topic: str) -> list[Any]:
        from kafka import TopicPartition

        if topic not in self._partitions:
            described = self._admin.describe_topics([topic])
            # the key is `partition_index` in newer metadata versions, `partition` in older
            self._partitions[topic] = [
                TopicPartition(topic, int(p.get("partition_index", p.get("partition", 0))))
                for p in described[0]["partitions"]
            ]
        return self._partitions[topic]

    def _offsets(self) -> tuple[dict[str, int], dict[str, int]]:
        """(end offset per topic, committed offset per stage summed over its input topic)."""
        from kafka.admin import OffsetSpec

        if self._admin is None:
            self._admin = make_admin(self.kafka)
        topics = {s.source for s in self.stages} | {t for s in self.stages for t in s.sinks}
        specs = {tp: OffsetSpec.LATEST for t in sorted(topics) for tp in self._topic_partitions(t)}
        ends: dict[str, int] = dict.fromkeys(topics, 0)
        for tp, info in self._admin.list_partition_offsets(specs).items():
            ends[tp.topic] += max(int(getattr(info, "offset", info)), 0)
        groups = self._admin.list_group_offsets({s.group: None for s in self.stages})
        committed: dict[str, int] = {}
        for stage in self.stages:
            offsets = groups.get(stage.group, {})
            committed[stage.name] = sum(
                max(int(meta.offset), 0) for tp, meta in offsets.items() if tp.topic == stage.source
            )
        return ends, committed

    def _steps(self) -> list[dict[str, Any]]:
        """New `step` records of the trainer's log since the last poll."""
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
        fresh, self._read = lines[self._read :], len(lines)
        out = []
        for line in fresh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self._read -= 1  # a line being written; read it again next time
                break
            if record.get("event") == "step":
                out.append(record)
            elif record.get("event") == "checkpoint":
                self.last.policy_version = int(record["version"])
        return out

    def _replicas(self) -> tuple[list[int | None], int]:
        versions: list[int | None] = []
        running = 0
        for url in self.replica_urls:
            try:
                with urllib.request.urlopen(url + "/info", timeout=2) as resp:
                    info = json.loads(resp.read())
                versions.append(int(info["version"]))
                running += int(info.get("running", 0)) + int(info.get("waiting", 0))
            except (OSError, ValueError, KeyError):
                versions.append(None)
        return versions, running

    def poll(self) -> Snapshot:
        snap = self.last
        snap.steps.extend(self._steps())
        if snap.steps:
            last = snap.steps[-1]
            hist = last.get("staleness_hist", {})
            total = sum(hist.values()) or 1
            snap.step = int(last["step"])
            snap.reward = last.get("reward_mean")
            recent = [float(r.get("reward_mean", 0.0)) for r in snap.steps[-5:]]
            snap.reward_recent = sum(recent) / len(recent)
            snap.stale_dropped = sum(int(r.get("stale_dropped", 0)) for r in snap.steps)
            snap.staleness = sum(int(k) * v for k, v in hist.items()) / total
        snap.replica_versions, snap.running = self._replicas()
        try:
            ends, committed = self._offsets()
        except KafkaError as exc:
            log.debug("offsets not available: %s", exc)
            return snap
        for stage in self.stages:
            consumed = committed[stage.name]
            produced = sum(ends[t] for t in stage.sinks)
            in_flight: int | None
            if stage.name == "agent-loop":
                in_flight = snap.running
            elif stage.name == "trainer":
                in_flight = None  # a half-collected batch is not visible from outside
            else:
                in_flight = max(consumed // stage.per_output - produced, 0)
            snap.stages[stage.name] = {
                "consumed": consumed,
                "produced": produced,
                "lag": max(ends[stage.source] - consumed, 0),
                "in_flight": in_flight,
            }
        return snap


def render(snap: Snapshot, *, max_steps: int, elapsed_s: float, title: str) -> Any:
    """A rich table: one row per stage, then the trainer's progress."""
    from rich.table import Table

    table = Table(title=f"{title} — {elapsed_s:5.0f}s", title_justify="left", expand=False)
    for column in ("stage", "consumed", "produced", "lag", "in flight", "notes"):
        table.add_column(column, justify="left" if column in ("stage", "notes") else "right")
    versions = ", ".join("?" if v is None else str(v) for v in snap.replica_versions)
    table.add_row("replicas", "", "", "", str(snap.running), f"serving versions [{versions}]")
    for name, numbers in snap.stages.items():
        note = ""
        if name == "trainer":
            reward = "-" if snap.reward is None else f"{snap.reward:.2f}"
            recent = "-" if snap.reward_recent is None else f"{snap.reward_recent:.2f}"
            stale = "-" if snap.staleness is None else f"{snap.staleness:.2f}"
            note = (
                f"step {snap.step}/{max_steps}  reward {reward} (last 5: {recent})  "
                f"staleness {stale}  stale-dropped {snap.stale_dropped}  "
                f"policy v{snap.policy_version}"
            )
        table.add_row(
            name,
            *(
                "-" if numbers[k] is None else str(numbers[k])
                for k in ("consumed", "produced", "lag", "in_flight")
            ),
            note,
        )
    return table
