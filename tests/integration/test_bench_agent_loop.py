"""`rollout bench agent-loop` end to end on the real broker and a real replica, tiny: one
round of each side, the fair CPU split on; two worker processes, unpinned (`long`).

The figures themselves are the benchmark's business (run it with the defaults); this checks
that one run measures every side, charges every component's CPU, reports the split and the
projection, and leaves this process's affinity as it found it.
"""

from __future__ import annotations

import os

import pytest

from pipeline.harness.bench.agent_loop import run
from workers.kafka.config import KafkaConfig

pytestmark = pytest.mark.kafka


def test_one_small_run_reports_every_figure(kafka_config: KafkaConfig) -> None:
    before = os.sched_getaffinity(0)
    # Enough generation for the replica's CPU (read in the kernel's 10 ms ticks) to count on
    # each side: with 4 trajectories of 4 tokens the Kafka side read 0 in a CI run.
    result = run(kafka_config, prompts=4, n=2, max_tokens=32, replicas=1, rounds=1)
    assert os.sched_getaffinity(0) == before
    assert result["trajectories"] == 8 and result["workers"] == 1
    if len(before) >= 2:
        low, high = sorted(before)[:2]
        assert result["cpu_split"] == {
            "loops": [low], "replicas": [low], "broker": [high], "reader": [high]
        }  # fmt: skip
    else:
        assert result["cpu_split"] is None and "1 usable CPU" in result["cpu_split_reason"]
    assert result["direct_trajectories_per_s"] > 0 and result["kafka_trajectories_per_s"] > 0
    assert len(result["ratio_runs"]) == 1 and result["ratio"] > 0
    per_traj = result["cpu_s_per_trajectory"]
    assert set(per_traj["direct"]) >= {"loops", "replicas"}
    assert set(per_traj["kafka"]) >= {"loops", "replicas", "reader"}
    # The worker generated on the replica: both sides charge it, and the worker's own CPU.
    assert per_traj["kafka"]["replicas"] > 0 and per_traj["kafka"]["loops"] > 0
    assert result["worker_cpu_ratio_to_direct"] is not None
    assert result["projected_trajectories_per_s"] > 0 and result["kafka_to_projected"] > 0
    assert "two_workers" not in result


@pytest.mark.long
def test_two_worker_processes_unpinned(kafka_config: KafkaConfig) -> None:
    result = run(
        kafka_config, prompts=2, n=2, max_tokens=4, replicas=1, rounds=1, workers=2, cpu_split=0
    )
    assert result["cpu_split"] is None
    assert result["cpu_split_reason"] == "turned off (--cpu-split 0)"
    per_traj = result["cpu_s_per_trajectory"]
    assert set(per_traj["kafka_2w"]) >= {"loops", "replicas", "reader", "workers"}
    assert per_traj["kafka_2w"]["workers"] > 0
    two = result["two_workers"]
    assert two["trajectories_per_s"] > 0 and len(two["ratio_to_one_worker_runs"]) == 1
    assert two["two_workers_to_projected"] > 0 and two["workers_cpu_ratio_to_one"] > 0
