"""Whole groups out of `rl.scored`, handed out so that a consumer's positions stay exact.

GRPO's advantage of a sample is its reward against the other samples of its prompt, so a
batch computed over half a group is silently wrong. `rl.scored` is keyed by uid, so every
sample of a group lies on one partition, but groups interleave there (many prompts are
generated at once). `WholeGroups` holds scored trajectories until their group is whole
(`group_size` distinct sample indexes) and releases them by *prefix*: per partition, the
longest run of records from the oldest held one on in which every group is whole and lies
wholly inside the run. So when a group is released, every record before its last one has
been released too, and the partition's position (the offset after the run) passes no record
that was not handed out: storing positions with what was built from the released groups and
resuming there still gives every record once, none skipped (`grpo_batches` is that reader).

A group that never becomes whole (a sample dead-lettered upstream, a worker that gave up)
blocks every group whose records straddle it (exact positions cannot pass it): after
`group_timeout_s` since its first sample it is released as it is and counted in
`partial_groups` (its reader is told; see `TrajectoryConsumer.batches`). That is the price
of positions that resume exactly; the replay stage, which keeps its groups in a changelog
instead, has no such head-of-line wait.
A record of a sample index already in its group (an upstream redelivery) is released with
the group and counted in `duplicates`, but not handed out twice. A trajectory without
`group_size` is a group of one. `WholeGroups` is pure logic: no Kafka, no clock of its own
(`now` is given).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafka import TopicPartition

from schemas.advantages import EPS

__all__ = ["REPLAY_DEFAULTS", "AdvantageSettings", "Released", "WholeGroups", "grpo_batches"]

log = logging.getLogger("rollout.trainer.consumer")


class AdvantageSettings(Protocol):
    """How GRPO advantages are computed: the replay stage's settings (a run's `cfg.replay`)."""

    @property
    def norm_adv_by_std(self) -> bool: ...

    @property
    def adv_eps(self) -> float: ...


@dataclass(frozen=True)
class _Settings:
    norm_adv_by_std: bool
    adv_eps: float


#: The replay stage's defaults (`TrajectoryConsumer.batches(advantages="grpo")`).
REPLAY_DEFAULTS: AdvantageSettings = _Settings(norm_adv_by_std=True, adv_eps=EPS)


@dataclass
class _Group:
    size: int
    started: float
    samples: dict[int, Any] = field(default_factory=dict)
    records: int = 0  # records of this group held (duplicates included)
    timed_out: bool = False

    @property
    def closed(self) -> bool:
        return len(self.samples) >= self.size or self.timed_out


@dataclass
class Released:
    """What one `take` releases: whole (or timed-out) groups, in release order, and the
    position after the released run of each partition that released anything."""

    groups: list[list[Any]] = field(default_factory=list)
    positions: dict[Any, int] = field(default_factory=dict)


class WholeGroups:
    """Hold scored trajectories; release whole groups by prefix (see the module docstring)."""

    def __init__(self, group_timeout_s: float | None = None) -> None:
        self.group_timeout_s = group_timeout_s
        self.partial_groups = 0
        self.duplicates = 0
        self._runs: dict[Any, deque[tuple[int, str]]] = {}  # partition → (next offset, uid)
        self._groups: dict[str, _Group] = {}

    def add(self, partition: Any, next_offset: int, event: Any, now: float) -> None:
        """One record of `partition` (`next_offset`: the offset after it) holding `event`."""
        group = self._groups.get(event.uid)
        if group is None:
            group = _Group(size=event.group_size or 1, started=now)
            self._groups[event.uid] = group
        if event.sample_index in group.samples:
            self.duplicates += 1
        else:
            group.samples[event.sample_index] = event
        group.records += 1
        self._runs.setdefault(partition, deque()).append((next_offset, event.uid))

    @property
    def held(self) -> int:
        """Groups held, not yet released."""
        return len(self._groups)

    @property
    def incomplete(self) -> int:
        """Groups held that are not whole (the rest wait behind one of them)."""
        return sum(not group.closed for group in self._groups.values())

    def holds(self, partition: Any) -> bool:
        """Whether any record of `partition` is still held."""
        return bool(self._runs.get(partition))

    def take(self, now: float) -> Released:
        """Release every group that can go now (timing out the ones past `group_timeout_s`)."""
        if self.group_timeout_s is not None:
            for group in self._groups.values():
                if not group.closed and now - group.started >= self.group_timeout_s:
                    group.timed_out = True
        out = Released()
        for partition, run in self._runs.items():
            cut, position = self._longest_whole_prefix(run)
            if not cut:
                continue
            released: list[str] = []
            for _ in range(cut):
                _, uid = run.popleft()
                if uid not in released:
                    released.append(uid)
            for uid in released:
                group = self._groups.pop(uid)
                self.partial_groups += group.timed_out and len(group.samples) < group.size
                out.groups.append([group.samples[i] for i in sorted(group.samples)])
            out.positions[partition] = position
        return out

    def _longest_whole_prefix(self, run: deque[tuple[int, str]]) -> tuple[int, int]:
        """(records, position after them) of the longest prefix of `run` in which every
        group is closed and has all its held records inside the prefix; (0, -1) if none."""
        seen: dict[str, int] = {}
        unfinished = 0  # groups in the prefix not closed or with records after it
        best = (0, -1)
        for i, (next_offset, uid) in enumerate(run):
            group = self._groups[uid]
            count = seen.get(uid, 0) + 1
            if count == 1:
                unfinished += 1
            seen[uid] = count
            if count == group.records and group.closed:
                unfinished -= 1
            if not group.closed:
                break  # this prefix, and every longer one, holds an open group
            if unfinished == 0:
                best = (i + 1, next_offset)
        return best


def grpo_batches(
    consumer: Any,
    size: int,
    max_wait_s: float | None,
    group_timeout_s: float | None,
    pad_token_id: int,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Iterator[Any]:
    """`TrajectoryConsumer.batches(size, advantages=...)` over `rl.scored`: batches of at
    least `size` whole groups with their GRPO advantages (`schemas.advantages`, with
    `norm_by_std` and `eps` the replay stage's `norm_adv_by_std` and `adv_eps`).

    A batch is made of whole released runs (so it may hold a few more than `size` groups when
    groups finish together): its partitions' positions then move to the end of those runs,
    and, until then, a partition with records held back reports the position of its first
    one (`consumer._hold`), so `positions()` and `commit()` never pass a record not handed
    out.
    """
    from workers.trainer.batching import collate, grpo_advantages

    held = WholeGroups(group_timeout_s)
    ready: list[list[Any]] = []
    ready_positions: dict[Any, int] = {}

    def batch() -> Any:
        samples = [s for group in ready for s in group]
        adv = grpo_advantages(
            [s.reward_score for s in samples],
            [s.uid for s in samples],
            norm_by_std=norm_by_std,
            eps=eps,
        )
        for partition, position in ready_positions.items():
            if held.holds(partition):
                consumer._hold[partition] = position
            else:
                consumer._hold.pop(partition, None)
        ready.clear()
        ready_positions.clear()
        return collate(samples, adv, pad_token_id=pad_token_id)

    while True:
        item = consumer.next_item(max_wait_s if max_wait_s is not None else 1.0)
        now = time.monotonic()
        if item is not None:
            partition = TopicPartition(item.topic, item.partition)
            consumer._hold.setdefault(partition, item.offset)
            held.add(partition, item.offset + 1, item.event, now)
        released = held.take(now)
        ready.extend(released.groups)
        ready_positions.update(released.positions)
        consumer.partial_groups = held.partial_groups
        if len(ready) >= size or (item is None and max_wait_s is not None and ready):
            yield batch()
        if item is None and max_wait_s is not None:
            if held.held:
                consumer.partial_groups += held.incomplete
                log.warning(
                    "%d groups not handed out after %.1f s without a record, %d of them "
                    "incomplete (the others lie behind one): positions stop before their "
                    "first sample, so a later read resumes there",
                    held.held,
                    max_wait_s,
                    held.incomplete,
                )
            return
