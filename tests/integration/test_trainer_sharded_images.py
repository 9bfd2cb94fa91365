"""The sharded trainer on a vision-language policy (issue 32): 2 gloo ranks (torchrun, FSDP2)
against the real broker train a step of image groups. Rank 0 reads the images from the media
store and sends the pixels to rank 1, which has no store: its weights after the step equal those
of the one-process trainer on the same groups, and the vision tower moved, so the pixels counted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO
from tests.integration.trainer_helpers import image_group, png, produce, small_trainer_config
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.weights.checkpoint import load_latest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _train(cfg_file: Path, tmp: Path) -> Path:
    """`rollout train` with `cfg_file` to its one step; the checkpoint it wrote."""
    cmd = [sys.executable, "-m", "pipeline.cli.main", "-v", "--config", str(cfg_file), "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    latest = load_latest(cfg_file.parent / "ckpt")
    assert latest is not None and latest.state.version == 1, done.stderr[-3000:]
    return latest.path


def test_two_ranks_train_image_groups_as_one_process_does(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, vl_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoProcessor

    from workers.media.store import MediaStore
    from workers.trainer.images import load_policy

    store = MediaStore(tmp_path / "store")
    red, blue = png((220, 0, 0)), png((0, 0, 220))
    policy = load_policy(vl_model, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(vl_model)
    groups = [
        image_group(policy, processor, "red", store.put(red, "image/png"), red),
        image_group(policy, processor, "blue", store.put(blue, "image/png"), blue),
    ]
    produce(kafka_config, topics_config.name("replay"), groups)

    weights = {}
    for nproc in (1, 2):
        run = tmp_path / f"nproc{nproc}"
        run.mkdir()
        cfg = small_trainer_config(
            run / "trainer.yaml", kafka_config, topics_config, vl_model, nproc=nproc, max_steps=1
        )
        settings = yaml.safe_load(cfg.read_text())
        cfg.write_text(yaml.safe_dump({**settings, "media": {"store_dir": str(store.root)}}))
        weights[nproc] = load_policy(_train(cfg, tmp_path), dtype=torch.float32).state_dict()

    one, two = weights[1], weights[2]
    assert sorted(one) == sorted(two)
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    before = policy.state_dict()
    vision = [k for k in one if "vision_tower" in k]
    moved = max(float((one[k] - before[k]).abs().max()) for k in vision)
    print({"max_abs_param_diff": diff, "vision_tower_moved": moved})
    assert vision and moved > 1e-6  # the images' pixels reached the step
    assert diff < 1e-5
