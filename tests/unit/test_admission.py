"""The staleness admission gate."""

from __future__ import annotations

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
