"""The staleness admission gate: generation may run at most `max_staleness` steps ahead.

A sample started now is trained, at the earliest, after every group started before it. If
`started` groups have been admitted and the trainer has consumed `trained` of them in
batches of `B`, a new group would be trained at least `(started − trained) / B` steps from
now; bounding `started − trained < (max_staleness + 1) × B` keeps every trained sample within
`max_staleness` versions of the policy that generated it (AReaL's rule, counted in groups):
a group admitted behind `k` unresolved ones is trained at a staleness of at least `k // B`,
and `(max_staleness + 1) × B` is the smallest `k` that is `schemas.stale.too_stale` for, the
rule the replay stage and the trainer drop by. With `max_staleness = 0` generation produces
one batch and waits for the trainer. Both numbers are the trainer's (`pipeline.config`
derives them): its `train_batch_size`, and its `max_staleness` less the gate's margin.

`trained` is the trainer's latest `PolicyVersion.groups_trained` on the policy topic (groups
it consumed: trained, or dropped as stale there). Groups that never reach the trainer must
count as resolved too, or the gate would hold their capacity for ever: `dropped` counts the
groups dropped upstream of it (on the stale topic without the trainer's header: the replay
stage's stale, zero-variance and timed-out groups) and the prompts this worker dead-lettered.
`started` must count the whole consumer group's admissions, not this worker's alone: two
workers each counting their own would keep twice the bound in flight, and a restarted worker
(its count back at 0 while `trained` is not) would admit without limit. The worker feeds it
the group's progress on the prompts topic (`observe_started`): the committed offsets of every
partition, with its own partitions' positions where they are ahead. Until the first such
count arrives (`synced`), nothing is admitted. Each worker commits how far it has started on
its partitions as the commit's metadata, so the count sees the others' prompts in flight too;
what it still misses is what they admitted since their last commit (about a second). And
since every worker sees the same free room at once, each takes its `share` of it (the share
of the topic's partitions it owns, rounded up), so together they do not take it twice.
Pure logic: the worker feeds it numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AdmissionGate"]


@dataclass
class AdmissionGate:
    max_staleness: int | None
    train_batch_size: int
    started: int = 0  # groups admitted (by the whole consumer group, as far as known)
    trained: int = 0  # groups the trainer has consumed
    dropped: int = 0  # groups resolved without reaching the trainer
    synced: bool = True  # False until the group's count arrived: admit nothing before it
    share: float = 1.0  # of the free room this worker may take (its share of the partitions)
    allowance: int = 0  # with a share below 1: what it may still take until the next count

    @property
    def capacity(self) -> int | None:
        """Groups that may be started and not yet resolved; None: unbounded."""
        if self.max_staleness is None:
            return None
        return (self.max_staleness + 1) * self.train_batch_size

    def can_admit(self) -> bool:
        return self.room() > 0

    def room(self) -> int:
        """How many more groups may start now (a large number when unbounded)."""
        capacity = self.capacity
        if capacity is None:
            return 1 << 30
        if not self.synced:
            return 0
        free = max(0, capacity - (self.started - self.trained - self.dropped))
        return free if self.share >= 1.0 else min(free, self.allowance)

    def admit(self) -> None:
        self.started += 1
        self.allowance = max(0, self.allowance - 1)

    def observe_trained(self, groups_trained: int) -> None:
        self.trained = max(self.trained, groups_trained)

    def observe_dropped(self, groups: int = 1) -> None:
        self.dropped += groups

    def observe_started(self, groups_started: int) -> None:
        """The consumer group's count from Kafka (prompts taken from the topic by every
        worker): it only ever raises the local count."""
        self.started = max(self.started, groups_started)
        self.synced = True
        self.share_room(self.share)

    def share_room(self, share: float) -> None:
        """Take `share` of the room free now until the next count (every worker sees the
        same free room at once; each takes its part, rounded up)."""
        self.share = share
        capacity = self.capacity
        if capacity is not None:
            free = max(0, capacity - (self.started - self.trained - self.dropped))
            self.allowance = math.ceil(free * share)
