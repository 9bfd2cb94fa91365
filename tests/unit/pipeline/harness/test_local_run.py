"""The one builder of a local run's config (benchmarks, chaos, soak)."""

from __future__ import annotations

from pathlib import Path

from pipeline.harness.local_run import local_run_config, merge
from workers.kafka.config import KafkaConfig


def test_merge_merges_mappings_and_replaces_the_rest() -> None:
    base = {"a": {"x": 1, "y": {"z": 2}}, "b": [1]}
    assert merge(base, {"a": {"y": {"w": 3}}, "b": [2]}) == {
        "a": {"x": 1, "y": {"z": 2, "w": 3}},
        "b": [2],
    }
    assert base == {"a": {"x": 1, "y": {"z": 2}}, "b": [1]}  # not mutated


def test_every_stage_shares_the_prefix_model_and_bounds() -> None:
    cfg = local_run_config(
        KafkaConfig(bootstrap_servers="h:1"),
        "run7.",
        "/m",
        Path("/r"),
        n=4,
        train_batch_size=2,
        max_tokens=8,
        max_staleness=1,
        overrides={"trainer": {"max_steps": 3}, "agent_loop": {"sampling": {"ignore_eos": True}}},
    )
    assert cfg.topics.name("prompts") == "run7.prompts"
    assert cfg.agent_loop.group_id == "run7.agent-loop" and cfg.trainer.group_id == "run7.trainer"
    assert cfg.reward.group_id == "run7.reward" and cfg.replay.group_id == "run7.replay"
    assert cfg.agent_loop.model == cfg.reward.tokenizer == cfg.trainer.model_dir == "/m"
    assert cfg.agent_loop.admission.max_staleness == cfg.replay.max_staleness == 1
    assert cfg.trainer.max_staleness == 1 and cfg.trainer.max_steps == 3
    assert cfg.agent_loop.sampling.ignore_eos and cfg.agent_loop.sampling.max_tokens == 8
    assert cfg.trainer.checkpoint_dir == "/r/ckpt"
