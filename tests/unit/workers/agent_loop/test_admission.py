"""The staleness admission gate."""

from __future__ import annotations

import pytest

from schemas.stale import too_stale
from workers.agent_loop.admission import AdmissionGate


def test_unbounded_gate_always_admits() -> None:
    gate = AdmissionGate(max_staleness=None, train_batch_size=4)
    for _ in range(1000):
        assert gate.can_admit()
        gate.admit()


def test_on_policy_gate_admits_one_batch_per_version() -> None:
    gate = AdmissionGate(max_staleness=0, train_batch_size=4)
    admitted = 0
    while gate.can_admit():
        gate.admit()
        admitted += 1
    assert admitted == 4
    gate.observe_trained(4)
    assert gate.can_admit()
    for _ in range(4):
        gate.admit()
    assert not gate.can_admit()


def test_staleness_two_runs_three_batches_ahead() -> None:
    gate = AdmissionGate(max_staleness=2, train_batch_size=3)
    while gate.can_admit():
        gate.admit()
    assert gate.started == 9
    gate.observe_trained(3)
    gate.observe_trained(1)  # an older report never moves it back
    assert gate.trained == 3
    assert gate.can_admit()
    gate.observe_started(20)  # other workers admitted more
    assert not gate.can_admit()


def test_groups_dropped_upstream_free_their_capacity() -> None:
    gate = AdmissionGate(max_staleness=0, train_batch_size=2)
    gate.admit()
    gate.admit()
    assert not gate.can_admit()
    gate.observe_dropped()  # e.g. a zero-variance group the replay stage dropped
    assert gate.room() == 1


def test_nothing_is_admitted_before_the_groups_count_arrives() -> None:
    gate = AdmissionGate(max_staleness=1, train_batch_size=2, synced=False)
    assert gate.room() == 0
    gate.observe_started(3)  # the group took 3 of the 4 the bound allows
    assert gate.room() == 1


def test_a_restarted_worker_counts_what_the_group_took_before_it() -> None:
    gate = AdmissionGate(max_staleness=1, train_batch_size=2, synced=False)
    gate.observe_trained(10)  # the trainer consumed 10 groups before this worker started
    gate.observe_started(14)  # and the group had started 14: the bound of 4 is reached
    assert gate.room() == 0
    gate.observe_trained(12)
    assert gate.room() == 2


def test_each_worker_takes_its_share_of_the_free_room_until_the_next_count() -> None:
    gate = AdmissionGate(max_staleness=4, train_batch_size=2)  # room for 10 groups
    gate.share = 0.5  # two workers, half of the partitions each
    gate.observe_started(0)
    taken = 0
    while gate.can_admit():
        gate.admit()
        taken += 1
    assert taken == 5  # not all 10: the other worker sees the same free room
    gate.observe_trained(2)
    assert gate.room() == 0  # until the next count
    gate.observe_started(8)  # the other took its 5 too, then the trainer freed 2
    assert gate.room() == 2  # ceil(4 free x 0.5)


@pytest.mark.parametrize(("bound", "batch"), [(0, 1), (0, 4), (2, 3), (8, 1), (32, 64)])
def test_the_gate_admits_exactly_what_trains_within_the_bound(bound: int, batch: int) -> None:
    """A group admitted behind `k` unresolved groups trains at least `k // batch` versions
    after it was generated: the gate admits it exactly when that is not `too_stale`."""
    for ahead in range((bound + 2) * batch + 1):
        gate = AdmissionGate(max_staleness=bound, train_batch_size=batch, started=ahead)
        assert gate.can_admit() == (not too_stale(ahead // batch, bound)), ahead
