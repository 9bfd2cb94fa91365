"""`rollout train --nproc 2 --ray ADDRESS`: two trainer ranks as two Ray actors (gloo on CPU),
against the real broker: rank 0 reads the replay topic and publishes on the policy topic, both
ranks write their shards of every checkpoint, every group is trained exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.integration.test_ray_launch import ray_address  # noqa: F401  (the fixture)
from tests.integration.trainer_helpers import (
    make_groups,
    policy_versions,
    produce,
    small_trainer_config,
)
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.trainer.steplog import effective_trajectory_ids
from workers.weights.checkpoint import load_latest

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.long]


def test_two_rank_actors_train_every_group_once_and_publish_versions(
    ray_address: str,  # noqa: F811
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    groups = make_groups(tiny_model, 8, prefix="ray")
    produce(kafka_config, topics_config.name("replay"), groups)
    ckpt = tmp_path / "ckpt"
    cfg_file = small_trainer_config(
        tmp_path / "run.yaml", kafka_config, topics_config, tiny_model, idle_timeout_s=4.0
    )

    done = run_cli(
        "--config",
        str(cfg_file),
        "train",
        "--nproc",
        "2",
        "--ray",
        ray_address,
        env={"OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    logs = {p.name: p.read_text()[-2000:] for p in (ckpt / "logs").glob("*.log")}
    assert done.returncode == 0, (done.stderr[-3000:], logs)
    assert sorted(logs) == ["train-rank-0.log", "train-rank-1.log"]  # one actor per rank

    result = json.loads(done.stdout.strip().splitlines()[-1])  # rank 0's, relayed
    assert result["steps"] == 4
    trained = effective_trajectory_ids(str(ckpt / "metrics.jsonl"))
    assert sorted(trained) == sorted(s.trajectory_id for g in groups for s in g.samples)
    versions = [v.version for v in policy_versions(kafka_config, topics_config.name("policy"))]
    assert versions == [2, 4]
    final = load_latest(str(ckpt))
    assert final is not None and final.state.version == 4 and final.state.groups_trained == 8
    # the distributed checkpoint holds a shard file from each rank
    shards = sorted(p.name for p in (ckpt / "sharded" / "step-4").glob("*.distcp"))
    assert len(shards) == 2, shards
