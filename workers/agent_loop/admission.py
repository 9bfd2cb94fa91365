"""The staleness admission gate: generation may run at most `max_staleness` steps ahead.

A sample started now is trained, at the earliest, after every group started before it. If
`started` groups have been admitted and the trainer has consumed `trained` of them in
batches of `B`, a new group would be trained at least `(started − trained) / B` steps from
now; bounding `started − trained < (max_staleness + 1) × B` keeps every trained sample within
`max_staleness` versions of the policy that generated it (AReaL's rule, counted in groups).
With `max_staleness = 0` generation produces one batch and waits for the trainer.

`started` is read from Kafka (the group's committed offsets on the prompts topic, plus this
worker's admitted-but-uncommitted prompts); `trained` from the trainer's latest
`PolicyVersion.groups_trained` on the policy topic. Pure logic: the worker feeds it numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdmissionGate"]


@dataclass
class AdmissionGate:
    max_staleness: int | None
    train_batch_size: int
    started: int = 0  # groups admitted (by the whole consumer group, as far as known)
    trained: int = 0  # groups the trainer has consumed

    @property
    def capacity(self) -> int | None:
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
        return max(0, capacity - (self.started - self.trained))

    def admit(self) -> None:
        self.started += 1

    def observe_trained(self, groups_trained: int) -> None:
        self.trained = max(self.trained, groups_trained)

    def observe_started(self, groups_started: int) -> None:
        """A fresher count from Kafka (e.g. after a rebalance or at start)."""
        self.started = max(self.started, groups_started)
