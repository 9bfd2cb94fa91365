"""Broadcast weights into vLLM (`weights.mode: broadcast`), on the CPU build.

Two vLLM replicas, each with its sync controller in a directory tree of its own and unable to
read the trainer's (tests/integration/broadcast_helpers.py), a tied-embedding model: they
serve nothing until they hold the trainer's version 0, then take A → B → A → B over the
trainer's gloo groups (`WeightSync.rollout_receive_weights` in vLLM's workers, through
collective_rpc); after each, each reports the trainer's version and its logprobs of a fixed
prompt equal a transformers fp32 forward pass of the trainer's weights within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.harness.models.tiny import init_model
from tests.integration.broadcast_helpers import (
    ReplicaTree,
    TestTrainer,
    four_updates,
    hide,
    load_model,
)
from tests.vllm.support import FAST_START, VLLM_CPU_ENV, VLLM_PYTHON
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = [pytest.mark.vllm, pytest.mark.kafka, pytest.mark.slow]

PROMPT = [(13 * i + 7) % 900 + 20 for i in range(24)]
TOLERANCE = 1e-4


def test_four_broadcast_updates_into_vllm_replicas_that_cannot_read_the_trainers_disk(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tmp_path: Path
) -> None:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} missing: build it with `make vllm`", pytrace=False)
    trainer_dir = tmp_path / "trainer"
    paths = {
        name: init_model(trainer_dir / "models" / name, seed=seed)
        for name, seed in (("v0", 2), ("A", 0), ("B", 1))
    }
    weights = {name: load_model(path) for name, path in paths.items()}
    own = init_model(tmp_path / "replicas-own-model", seed=3)
    hide(trainer_dir)
    serve = ("--vllm-python", str(VLLM_PYTHON), "--max-model-len", "2048", "--dtype", "float32")
    replicas = [
        ReplicaTree(
            tmp_path,
            f"vllm-{i}",
            own,
            kafka_config.bootstrap,
            topics_config.prefix,
            *serve,
            *FAST_START,
            backend="vllm",
            env=VLLM_CPU_ENV,
        )
        for i in range(2)
    ]
    trainer = TestTrainer(kafka_config, topics_config, trainer_dir / "checkpoints", paths["A"])
    try:
        for replica in replicas:
            replica.start_replica()
            replica.start_sync()
        for line in four_updates(replicas, trainer, weights, PROMPT, TOLERANCE, startup_s=900):
            print(line)
    finally:
        for replica in replicas:
            replica.stop()
        trainer.close()
        trainer_dir.chmod(0o700)
