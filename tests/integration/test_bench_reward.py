"""`rollout bench reward` end to end on the real broker, at a size that runs in seconds.

The figures themselves are the benchmark's business (run it with the defaults); this checks
that one run measures every rate it reports and that the stage scored every trajectory.
"""

from __future__ import annotations

import pytest

from pipeline.harness.bench.reward import run
from workers.kafka.config import KafkaConfig

pytestmark = pytest.mark.kafka


def test_one_small_run_reports_every_rate(kafka_config: KafkaConfig) -> None:
    result = run(kafka_config, trajectories=60, math_items=4, runs=1, timeout_s=120)
    for rate in (
        "stage_trajectories_per_s",
        "copy_aiokafka_msgs_per_s",
        "copy_kafka_python_msgs_per_s",
        "copy_decoding_msgs_per_s",
        "math_verify_items_per_s",
    ):
        assert result[rate] > 0, (rate, result)
    assert len(result["copy_aiokafka_runs_msgs_per_s"]) == 1
    assert len(result["stage_runs_trajectories_per_s"]) == 1
    assert result["ratio"] > 0 and result["target_ratio"] == 0.5
    assert result["ratio"] == pytest.approx(
        result["stage_trajectories_per_s"] / (result["copy_trajectories_per_s"]), abs=0.01
    )
    assert result["stage_outputs"] == 60
    assert result["stage_batches"] >= 1 and "t_batch" in result["stage_seconds"]
