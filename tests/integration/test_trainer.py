"""The trainer against the real broker: steps, checkpoints, PolicyVersion, stale groups,
kill -9 and restart (no group trained twice, none skipped), and the replica sync controller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

from schemas import headers as h
from schemas.stale import is_trainer_drop
from tests.conftest import REPO, ROLLOUT, ReplicaProcess
from tests.integration.trainer_helpers import make_groups, policy_versions, produce, read_all
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.metrics import TrainerMetrics
from workers.trainer.config import TrainerConfig
from workers.trainer.steplog import effective_steps, effective_trajectory_ids
from workers.trainer.trainer import run_trainer
from workers.weights.checkpoint import load_latest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _config(model: Path, root: Path, **kw: object) -> TrainerConfig:
    base: dict[str, object] = {
        "model_dir": str(model),
        "checkpoint_dir": str(root / "ckpt"),
        "train_batch_size": 2,
        "micro_batch_size": 2,
        "sync_every": 2,
        "torch_threads": 1,
        "idle_timeout_s": 3.0,
        "poll_timeout_s": 0.2,
        "group_id": f"trainer-{root.name}",
    }
    base.update(kw)
    return TrainerConfig.model_validate(base)


def test_steps_checkpoint_and_publish(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tiny_model: Path, tmp_path: Path
) -> None:
    groups = make_groups(tiny_model, 8, prefix="a")
    produce(kafka_config, topics_config.name("replay"), groups)
    cfg = _config(tiny_model, tmp_path, max_steps=4)
    metrics = TrainerMetrics()
    result = run_trainer(kafka_config, topics_config, cfg, metrics=metrics)
    assert result.version == 4 and result.steps == 4 and result.stopped_by == "max_steps"
    value = metrics.registry.get_sample_value
    train = {"stage": "train"}
    assert value("rollout_trainer_steps_total", train) == 4
    assert value("rollout_policy_version", train) == 4
    assert value("rollout_staleness_count", train) == 8  # 2 groups a step, when trained
    policy, replay = topics_config.name("policy"), topics_config.name("replay")
    assert value("rollout_messages_consumed_total", {**train, "topic": replay}) == 8
    assert value("rollout_messages_produced_total", {**train, "topic": policy}) == 2

    steps = effective_steps(cfg.metrics_path)
    assert sorted(steps) == [1, 2, 3, 4]
    first = steps[1]
    # behaviour logprobs came from these very weights: staleness 0, importance weights ≈ 1
    assert first["staleness_hist"] == {"0": 2}
    assert first["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["is_weight_min"] == pytest.approx(1.0, abs=1e-3)
    assert first["is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert first["pg_clipfrac"] == 0.0 and first["trajectory_spans_max"] == 1
    for key in ("loss", "entropy", "grad_norm", "behav_kl"):
        assert isinstance(first[key], float)
    # later steps train version-0 samples on newer weights: staleness > 0, weights move off 1
    assert steps[4]["staleness_hist"] == {"3": 2}
    assert abs(steps[4]["is_weight_mean"] - 1.0) > 1e-5

    latest = load_latest(cfg.checkpoint_dir)
    assert latest is not None and latest.path.name == "step-4"
    assert sum(latest.state.positions.values()) == 8
    assert latest.state.groups_trained == 8 and latest.state.samples_trained == 16
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "optimizer/state.safetensors",
    ):
        assert (latest.path / name).is_file(), name

    versions = policy_versions(kafka_config, topics_config.name("policy"))
    assert [(v.version, v.groups_trained, v.samples_trained) for v in versions] == [
        (2, 4, 8),
        (4, 8, 16),
    ]
    assert versions[-1].path == str(latest.path)

    # the replica's loader accepts the checkpoint as it is
    from transformers import AutoModelForCausalLM

    from workers.weights import load as weights

    served = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    weights.read_checkpoint(latest.path, weights.targets(served))


def test_stale_groups_go_to_the_stale_topic(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tiny_model: Path, tmp_path: Path
) -> None:
    groups = make_groups(tiny_model, 5, prefix="s")
    produce(kafka_config, topics_config.name("replay"), groups)
    cfg = _config(tiny_model, tmp_path, train_batch_size=1, sync_every=1, max_staleness=1)
    result = run_trainer(kafka_config, topics_config, cfg)
    # versions 0 and 1 train two groups; at version 2 every version-0 group is too old
    assert result.version == 2 and result.stopped_by == "idle"
    stale = read_all(kafka_config, topics_config.name("stale"), timeout_s=2.0)
    stale_uids = [r.key.decode() for r in stale]
    trained = [u for r in effective_steps(cfg.metrics_path).values() for u in r["uids"]]
    assert len(stale_uids) == 3 and len(trained) == 2
    assert sorted(stale_uids + trained) == [g.uid for g in groups]
    assert all(dict(r.headers)[h.DROP_REASON] == b"stale" for r in stale)
    assert all(is_trainer_drop(r.headers) for r in stale)
    latest = load_latest(cfg.checkpoint_dir)
    assert latest is not None
    assert latest.state.groups_stale == 3 and latest.state.groups_consumed == 5
    # the gate's counter includes what was dropped, or generation would wait for ever
    assert policy_versions(kafka_config, topics_config.name("policy"))[-1].groups_trained == 5


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "trainer exited early"
        if metrics.exists():
            lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            if any(r.get("event") == "step" and r["step"] >= step for r in lines):
                return
        time.sleep(0.1)
    raise TimeoutError(f"step {step} not reached")


def test_kill_9_between_checkpoints_trains_every_group_exactly_once(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tiny_model: Path, tmp_path: Path
) -> None:
    groups = make_groups(tiny_model, 12, prefix="k")
    replay = topics_config.name("replay")
    # Two updates per step (one group each) and a KL term: the resumed trainer reloads the
    # reference model from the run's source, and still trains no group twice.
    cfg = _config(tiny_model, tmp_path, idle_timeout_s=None, ppo_mini_batches=2, kl_coef=0.05)
    stage = {
        "kafka": {"bootstrap_servers": kafka_config.bootstrap},
        "topics": {"prefix": topics_config.prefix},
        "trainer": cfg.model_dump(mode="json"),
    }
    cfg_file = tmp_path / "trainer.yaml"
    cfg_file.write_text(yaml.safe_dump(stage))
    log = (tmp_path / "trainer.log").open("ab")
    cmd = [*ROLLOUT, "--config", str(cfg_file), "-v", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    # run 1: 6 groups = 3 steps; checkpoint at 2; step 3 trained but never checkpointed
    produce(kafka_config, replay, groups[:6])
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log, env=env)
    try:
        _wait_for_step(Path(cfg.metrics_path), 3, proc, timeout=120)
        time.sleep(0.5)  # now idle, waiting for step 4's groups
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    latest = load_latest(cfg.checkpoint_dir)
    assert latest is not None and latest.state.version == 2

    # run 2: the rest arrives; the restarted trainer resumes from step-2 and drains everything
    produce(kafka_config, replay, groups[6:])
    stage["trainer"]["idle_timeout_s"] = 4.0
    cfg_file.write_text(yaml.safe_dump(stage))
    done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=log, env=env, timeout=180, check=False)
    assert done.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]

    trained = effective_trajectory_ids(cfg.metrics_path)
    expected = sorted(s.trajectory_id for g in groups for s in g.samples)
    assert sorted(trained) == expected  # no duplicates, no gaps
    raw = [json.loads(x) for x in Path(cfg.metrics_path).read_text().splitlines()]
    step_lines = Counter(r["step"] for r in raw if r["event"] == "step")
    assert {r["optimizer_updates"] for r in raw if r["event"] == "step"} == {2.0}
    assert step_lines[3] == 2  # step 3 was lost with the killed process and trained again
    assert [r["version"] for r in raw if r["event"] == "start"] == [0, 2]
    final = load_latest(cfg.checkpoint_dir)
    assert final is not None and final.state.version == 6
    assert final.state.groups_trained == 12 and sum(final.state.positions.values()) == 12
    assert [v.version for v in policy_versions(kafka_config, topics_config.name("policy"))] == [
        2,
        4,
        6,
    ]


def _health_version(address: str) -> int:
    with urllib.request.urlopen(address + "/health", timeout=5) as resp:
        return int(json.loads(resp.read())["version"])


def test_controller_moves_a_replica_to_the_published_version(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tiny_model: Path, tmp_path: Path
) -> None:
    from workers.weights.sync import run_controller

    replica = ReplicaProcess(tiny_model, "hf-sync", tmp_path)
    try:
        produce(kafka_config, topics_config.name("replay"), make_groups(tiny_model, 2, prefix="c"))
        cfg = _config(tiny_model, tmp_path, sync_every=1, max_steps=1)
        assert run_trainer(kafka_config, topics_config, cfg).version == 1
        replica.wait_healthy()
        assert _health_version(replica.address) == 0
        stop = threading.Event()
        result: dict[str, object] = {}
        thread = threading.Thread(
            target=lambda: result.update(
                sync=run_controller(kafka_config, topics_config, replica.address, stop)
            ),
            daemon=True,
        )
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while _health_version(replica.address) != 1:
                assert time.monotonic() < deadline, "replica did not load version 1"
                time.sleep(0.2)
            body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 1.0}).encode()
            request = urllib.request.Request(
                replica.address + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert json.loads(resp.read())["policy_version"] == 1
        finally:
            stop.set()
            thread.join(timeout=10)
        sync = result["sync"]
        assert sync.applied == [1]  # type: ignore[attr-defined]
    finally:
        replica.stop()


def test_a_resumed_trainer_outlives_the_pruning_of_the_checkpoint_it_resumed_from(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tiny_model: Path, tmp_path: Path
) -> None:
    """Each checkpoint copies its tokenizer files from the one before: never from the
    checkpoint a restart resumed from, which keep_checkpoints=2 prunes two saves later."""
    produce(kafka_config, topics_config.name("replay"), make_groups(tiny_model, 10, prefix="r"))
    cfg = _config(tiny_model, tmp_path, max_steps=1, sync_every=1, keep_checkpoints=2)
    assert run_trainer(kafka_config, topics_config, cfg).version == 1
    resumed = run_trainer(kafka_config, topics_config, cfg.model_copy(update={"max_steps": 5}))
    assert resumed.version == 5 and resumed.steps == 4
    latest = load_latest(cfg.checkpoint_dir)
    assert latest is not None and (latest.path / "tokenizer.json").is_file()
    assert not (Path(cfg.checkpoint_dir) / "step-1").exists()  # pruned while it ran
