"""Pure logic of the replay stage: assemble groups, judge staleness, compute advantages.

A group is the `n` samples of one prompt (uid). It is complete when `n` distinct
`sample_index`es are in (a duplicate trajectory id — a redelivery or a second attempt that
also completed — is dropped and counted). A group that waits longer than the timeout is
emitted partial or dropped, by policy.

Staleness of a group = `schemas.stale.staleness(current policy version, the group's
min_global_steps)` (its oldest token's version); past `max_staleness` (`schemas.stale.too_stale`)
it goes to the stale topic (policy `drop`) or on to training anyway (`keep`).

`judge` decides in this order, the first that applies naming the drop reason: a partial
group under partial policy `drop` → `timeout`; too stale under `drop` → `stale`; all rewards
equal (a single sample included) with dynamic sampling on → `zero_variance`. A dropped group
still carries its advantages, so what lands on the stale topic can be analysed or reused.

Advantages (GRPO): `schemas.advantages.group_advantages`, the one definition shared with
`TrajectoryConsumer` (sample std; Dr. GRPO turns the division off). A group whose rewards are
all equal carries no signal; with dynamic sampling (DAPO) it is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from schemas.advantages import EPS, group_advantages
from schemas.events import ScoredTrajectory, TrainingGroup
from schemas.stale import DropReason, StalePolicy, staleness, too_stale

__all__ = ["Decision", "GroupBuffer", "PendingGroup", "group_advantages", "judge"]


@dataclass
class PendingGroup:
    uid: str
    expected: int
    first_seen: float = field(default_factory=time.monotonic)
    samples: dict[int, ScoredTrajectory] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.expected


@dataclass(frozen=True)
class Decision:
    """What to do with a finished (complete or timed-out) group."""

    group: TrainingGroup | None
    drop: DropReason | None
    staleness: int


class GroupBuffer:
    """Incomplete groups by uid; `add` returns the group when it completes."""

    def __init__(self, default_n: int) -> None:
        self.default_n = default_n
        self.pending: dict[str, PendingGroup] = {}
        self.duplicates = 0

    def add(self, sample: ScoredTrajectory, expected: int | None = None) -> PendingGroup | None:
        group = self.pending.get(sample.uid)
        if group is None:
            group = self.pending[sample.uid] = PendingGroup(sample.uid, expected or self.default_n)
        if sample.sample_index in group.samples:
            self.duplicates += 1
            return None
        group.samples[sample.sample_index] = sample
        if group.complete:
            return self.pending.pop(sample.uid)
        return None

    def expired(self, timeout_s: float, now: float | None = None) -> list[PendingGroup]:
        now = time.monotonic() if now is None else now
        late = [g for g in self.pending.values() if now - g.first_seen >= timeout_s]
        for group in late:
            del self.pending[group.uid]
        return late


def judge(
    group: PendingGroup,
    *,
    current_version: int,
    max_staleness: int | None,
    stale_policy: StalePolicy,
    drop_zero_variance: bool,
    norm_adv_by_std: bool,
    partial_policy: Literal["emit", "drop"] = "emit",
    adv_eps: float = EPS,
) -> Decision:
    """Partial policy, staleness policy, dynamic sampling and advantages for one group.

    The keyword arguments after `current_version` are `ReplayConfig`'s settings of the same
    names (the stage passes them by name)."""
    samples = [group.samples[i] for i in sorted(group.samples)]
    low = min(s.extra_fields.min_global_steps for s in samples)
    high = max(s.extra_fields.max_global_steps for s in samples)
    lag = staleness(current_version, low)
    rewards = [s.reward_score for s in samples]
    built = TrainingGroup(
        uid=group.uid,
        samples=samples,
        advantages=group_advantages(rewards, norm_by_std=norm_adv_by_std, eps=adv_eps),
        min_global_steps=low,
        max_global_steps=high,
        emitted_at_version=current_version,
    )
    if not group.complete and partial_policy == "drop":
        return Decision(built, "timeout", lag)
    if too_stale(lag, max_staleness) and stale_policy == "drop":
        return Decision(built, "stale", lag)
    if drop_zero_variance and max(rewards) == min(rewards):
        return Decision(built, "zero_variance", lag)
    return Decision(built, None, lag)
