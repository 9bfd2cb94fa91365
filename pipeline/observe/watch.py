"""Watching a local run from start to end: what its data allows, its progress, its report.

What `rollout up` shows a user of their own data, as the demo shows its own:

- `data_outlook(cfg)` before any stage starts: how many prompts wait on the prompts topic
  (produced, not yet taken by the run's agent-loop group), how many steps of
  `trainer.train_batch_size` groups they make, and whether that reaches `trainer.max_steps`
  from the version the run resumes at (each prompt is one group of its `n` samples; groups
  dropped as stale or zero-variance make the real count lower, never higher).
- `RunWatch.poll()` every second while the run is up: the live table of
  `pipeline.observe.progress` on a terminal, else one line per trainer step (step, reward,
  staleness, stale-dropped, policy version, the lag of each stage, and what the reward and
  replay stages dropped as already done, from their stats files), so a log shows it too;
  and once a wait begins, one line when the run is idle (`IDLE_S` without a step, every
  prompt taken, nothing generating, no record waiting at any stage): the trainer waits for
  prompts that were never produced, which would otherwise look like a hang.
- `RunWatch.report(out_dir, wall_s)` at the end: the report of `pipeline.observe.report`
  (`report.png`, metrics as CSV/JSON, `summary.json`/`.txt`), returned as its summary text.

Reads Kafka, the replicas' `/info` and the trainer's step log; never touches a stage.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pipeline.config import RunConfig
from pipeline.observe.progress import Progress, Snapshot, StageSpec, render

__all__ = ["DONE_COUNTERS", "IDLE_S", "DataOutlook", "RunWatch", "data_outlook", "stage_specs"]

#: Seconds without a step, with nothing waiting or generating, before the run is said idle.
IDLE_S = 30.0

#: The counters of the stateful stages' stats files that count records dropped as done.
DONE_COUNTERS = {
    "reward": ("after_done", "duplicate_completion"),
    "replay": ("duplicates", "late_samples"),
}


def stage_specs(cfg: RunConfig) -> list[StageSpec]:
    """The four stages as the view sees them: consumer group, input and output topics."""
    t = cfg.topics.name
    n = cfg.replay.n
    return [
        StageSpec("agent-loop", cfg.agent_loop.group_id, t("prompts"), (t("turns"),)),
        StageSpec("reward", cfg.reward.group_id, t("turns"), (t("scored"),)),
        StageSpec("replay", cfg.replay.group_id, t("scored"), (t("replay"), t("stale")), n),
        StageSpec("trainer", cfg.trainer.group_id, t("replay"), (t("policy"),)),
    ]


@dataclass(frozen=True)
class DataOutlook:
    """What the prompts waiting on the topic allow the run to train."""

    topic: str
    waiting: int  # prompts produced and not yet taken by the agent-loop group
    batch: int  # groups per step
    version: int  # the step the run resumes at (0: a new run)
    max_steps: int | None

    @property
    def steps(self) -> int:
        """Steps the waiting prompts make, at most (one group each)."""
        return self.waiting // self.batch

    def lines(self) -> list[str]:
        have = (
            f"{self.waiting} prompts wait on {self.topic}: at most {self.steps} steps of "
            f"{self.batch} groups (trainer.train_batch_size)"
        )
        if self.version:
            have += f", from version {self.version}"
        out = [have]
        if self.max_steps is not None and self.version + self.steps < self.max_steps:
            out.append(
                f"--steps {self.max_steps} needs "
                f"{(self.max_steps - self.version) * self.batch - self.waiting} prompts more: "
                f"after step {self.version + self.steps} the trainer waits for them "
                "(`rollout produce` more, or lower --steps)"
            )
        return out


def data_outlook(cfg: RunConfig, version: int = 0) -> DataOutlook:
    """Count the prompts waiting for the run's agent-loop group (end − committed offsets)."""
    from kafka import TopicPartition
    from kafka.admin import OffsetSpec

    from workers.kafka.admin import group_offsets
    from workers.kafka.clients import make_admin

    topic = cfg.topics.name("prompts")
    admin = make_admin(cfg.kafka)
    try:
        described = admin.describe_topics([topic])
        parts = [
            TopicPartition(topic, int(p.get("partition_index", p.get("partition", 0))))
            for p in described[0]["partitions"]
        ]
        ends = admin.list_partition_offsets(dict.fromkeys(parts, OffsetSpec.LATEST))
        starts = admin.list_partition_offsets(dict.fromkeys(parts, OffsetSpec.EARLIEST))
    finally:
        admin.close()
    committed = group_offsets(cfg.kafka, cfg.agent_loop.group_id)
    waiting = 0
    for tp in parts:
        end = int(getattr(ends[tp], "offset", ends[tp]))
        start = int(getattr(starts[tp], "offset", starts[tp]))
        at = committed.get(tp)
        taken = int(at.offset) if at is not None and int(at.offset) >= 0 else start
        waiting += max(end - max(taken, start), 0)
    return DataOutlook(
        topic=topic,
        waiting=waiting,
        batch=cfg.trainer.train_batch_size,
        version=version,
        max_steps=cfg.trainer.max_steps,
    )


class RunWatch:
    """The progress of one local run, polled by its launcher; the report at its end."""

    def __init__(
        self,
        cfg: RunConfig,
        replica_urls: list[str],
        *,
        title: str,
        stream: TextIO | None = None,
        live: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.title = title
        self.stream = stream or sys.stderr
        self.max_steps = cfg.trainer.max_steps or 0
        self.progress = Progress(
            cfg.kafka, stage_specs(cfg), replica_urls, cfg.trainer.metrics_path
        )
        self.started = time.monotonic()
        self.launched = time.time()
        self._printed = 0  # step records already printed as lines
        self._steps_seen, self._step_at = 0, self.started  # the last step, and since when
        self._idle_said: int | None = None  # the step count an idle line was written at
        self._live: Any = None
        if live if live is not None else self.stream.isatty():
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream)
            self._live = Live(console=console, refresh_per_second=2, transient=False)
            self._live.start()

    def poll(self) -> Snapshot:
        snap = self.progress.poll()
        if self._live is not None:
            elapsed = time.monotonic() - self.started
            self._live.update(
                render(snap, max_steps=self.max_steps, elapsed_s=elapsed, title=self.title)
            )
        else:
            for record in snap.steps[self._printed :]:
                self.stream.write(self._line(record, snap) + "\n")
            self._printed = len(snap.steps)
        if (idle := self.idle_line(snap, time.monotonic())) is not None:
            if self._live is not None:
                self._live.console.print(idle, markup=False, highlight=False)
            else:
                self.stream.write(idle + "\n")
        if self._live is None:
            self.stream.flush()
        return snap

    def idle_line(self, snap: Snapshot, now: float) -> str | None:
        """The line that says the run waits for prompts, once per wait (None otherwise):
        no step for `IDLE_S`, `max_steps` not reached, the agent loop generating nothing and
        no stage with records waiting."""
        if len(snap.steps) != self._steps_seen:
            self._steps_seen, self._step_at = len(snap.steps), now
            return None
        if self._idle_said == self._steps_seen or now - self._step_at < IDLE_S:
            return None
        if self.max_steps and snap.step >= self.max_steps:
            return None
        stages = [numbers for numbers in snap.stages.values() if numbers]
        agent = snap.stages.get("agent-loop") or {}
        if not stages or any(numbers.get("lag") for numbers in stages):
            return None
        if agent.get("in_flight") != 0:
            return None
        self._idle_said = self._steps_seen
        prompts = self.cfg.topics.name("prompts")
        at = f"after step {snap.step}" if snap.steps else "before its first step"
        return (
            f"rollout: idle {at} for {now - self._step_at:.0f}s: every prompt on {prompts} is "
            "taken, nothing is generating and no stage has records waiting; the trainer waits "
            f"for more groups (`rollout --set topics.prefix={self.cfg.topics.prefix} produce` "
            "more prompts, or Ctrl-C: the checkpoints are kept)"
        )

    def _line(self, record: dict[str, Any], snap: Snapshot) -> str:
        hist = record.get("staleness_hist", {})
        total = sum(hist.values()) or 1
        staleness = sum(int(k) * v for k, v in hist.items()) / total
        reward = record.get("reward_mean")
        lags = "  ".join(
            f"{name} {numbers['lag']}" for name, numbers in snap.stages.items() if numbers
        )
        of = f"/{self.max_steps}" if self.max_steps else ""
        done = self.dropped_as_done()
        return (
            f"step {record['step']}{of}  reward "
            f"{'-' if reward is None else f'{float(reward):.3f}'}  staleness {staleness:.2f}  "
            f"stale-dropped {int(record.get('stale_dropped', 0))}  "
            f"samples {int(record.get('samples', 0))}  {time.monotonic() - self.started:.0f}s"
            + (f"  lag: {lags}" if lags else "")
            + (f"  dropped as already done: {done}" if done else "")
        )

    def dropped_as_done(self) -> str:
        """What the reward and replay stages dropped as already done, from their stats files
        ('' when nothing was): a dataset produced twice under the same uids shows here."""
        said = []
        for section, names in DONE_COUNTERS.items():
            path = getattr(self.cfg, section).stats_path
            try:
                counts = json.loads(Path(path).read_text()) if path else {}
            except (OSError, ValueError):
                continue
            if total := sum(int(counts.get(name, 0)) for name in names):
                said.append(f"{section} {total}")
        return ", ".join(said)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        self.progress.close()

    def steps(self) -> list[dict[str, Any]]:
        """This run's step records, one per step (the last of each, after a restart)."""
        from workers.trainer.steplog import effective_steps

        metrics = Path(self.cfg.trainer.metrics_path)
        return list(effective_steps(metrics).values()) if metrics.exists() else []

    def report(self, out_dir: Path, *, wall_s: float, info: dict[str, Any]) -> str:
        """Write the report into `out_dir`; the summary as text (its first lines the reward
        over the first and last 10% of steps)."""
        from pipeline.observe.report import write_report

        summary = write_report(
            out_dir, self.steps(), wall_s=wall_s, info=info, started_at=self.launched,
            title=self.title,
        )  # fmt: skip
        return (
            f"reward_first_10pct {summary['reward_first_10pct']:.3f}\n"
            f"reward_last_10pct {summary['reward_last_10pct']:.3f}\n"
            + (Path(out_dir) / "summary.txt").read_text()
        )
