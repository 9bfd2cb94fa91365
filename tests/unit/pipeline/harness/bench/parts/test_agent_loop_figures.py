"""The agent-loop bench's CPU arithmetic: per trajectory, per core, the projection."""

from __future__ import annotations

import pytest

from pipeline.harness.bench.parts.agent_loop_figures import cpu_figures, projection


def test_cpu_per_trajectory_is_the_median_round_over_the_trajectories() -> None:
    cpu = {
        "direct": {"loops": [1.0, 3.0, 2.0], "replicas": [10.0, 10.0, 12.0]},
        "kafka": {"loops": [2.2, 2.4, 9.0], "replicas": [11.0, 10.0, 10.5], "reader": [0.5]},
    }
    out = cpu_figures(cpu, samples=100)
    assert out["cpu_s_per_trajectory"]["direct"] == {"loops": 0.02, "replicas": 0.1}
    assert out["cpu_s_per_trajectory"]["kafka"]["loops"] == 0.024
    assert out["trajectories_per_core_s"]["kafka"]["reader"] == 200.0
    assert out["worker_cpu_ratio_to_direct"] == 1.2


def test_no_loops_cpu_gives_no_ratio() -> None:
    out = cpu_figures({"direct": {"loops": [0.0]}, "kafka": {"loops": [1.0]}}, samples=1)
    assert out["worker_cpu_ratio_to_direct"] is None


def test_pinned_projection_is_the_busiest_core() -> None:
    per_traj = {"loops": 0.002, "replicas": 0.028, "broker": 0.001, "reader": 0.001}
    groups = {"loops": "a", "replicas": "a", "broker": "b", "reader": "b"}
    assert projection(per_traj, groups, cpus=2) == pytest.approx(1 / 0.030)
    # A component the split does not place (a second worker's bench process) is not charged.
    assert projection({**per_traj, "workers": 5.0}, groups, cpus=2) == pytest.approx(1 / 0.030)


def test_unpinned_projection_shares_every_cpu() -> None:
    per_traj = {"loops": 0.002, "replicas": 0.028, "broker": 0.006, "reader": 0.004}
    assert projection(per_traj, None, cpus=2) == pytest.approx(2 / 0.040)
    assert projection({}, None, cpus=2) == 0.0
