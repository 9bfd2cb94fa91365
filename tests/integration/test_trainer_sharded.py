"""The sharded trainer: 2 gloo ranks (torchrun, FSDP2) against the real broker; one rank killed
with SIGKILL between checkpoints, the trainer restarted: every group trained exactly once, the
consolidated checkpoint loadable as an HF model, the sharded state next to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.trainer_helpers import (
    make_groups,
    policy_versions,
    produce,
    small_trainer_config,
)
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.trainer.steplog import effective_trajectory_ids
from workers.weights.checkpoint import load_latest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        out += [int(c) for c in children]
        todo += [int(c) for c in children]
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun rank `rank` under our own launcher process (by its environment)."""
    for pid in _descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return pid
    return None


def _steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return [r["step"] for r in lines if r.get("event") == "step"]


def test_two_ranks_kill_one_restart_every_group_exactly_once(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, tiny_model: Path, tmp_path: Path
) -> None:
    groups = make_groups(tiny_model, 12, prefix="s")
    replay = topics_config.name("replay")
    cfg_file = small_trainer_config(
        tmp_path / "trainer.yaml", kafka_config, topics_config, tiny_model, nproc=2
    )
    metrics = tmp_path / "ckpt" / "metrics.jsonl"
    log_path = tmp_path / "trainer.log"
    log = log_path.open("ab")
    # trainer.nproc=2: `rollout train` relaunches itself under torchrun
    cmd = [sys.executable, "-m", "pipeline.cli.main", "-v", "--config", str(cfg_file), "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    # run 1: 6 groups = 3 steps; checkpoint at 2; step 3 trained, never checkpointed; rank 1 dies
    produce(kafka_config, replay, groups[:6])
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 120
        while 3 not in _steps(metrics):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 3 within 120 s"
            time.sleep(0.1)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=90) != 0  # torchrun stops the other rank and fails
    finally:
        if proc.poll() is None:
            for pid in _descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait()
    latest = load_latest(tmp_path / "ckpt")
    assert latest is not None and latest.state.version == 2

    # run 2: the rest arrives; the restarted ranks resume from step-2 and drain everything
    produce(kafka_config, replay, groups[6:])
    small_trainer_config(
        cfg_file, kafka_config, topics_config, tiny_model, nproc=2, idle_timeout_s=4.0
    )
    done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=log, env=env, timeout=180, check=False)
    assert done.returncode == 0, log_path.read_text()[-3000:]

    trained = effective_trajectory_ids(str(metrics))
    assert sorted(trained) == sorted(s.trajectory_id for g in groups for s in g.samples)
    assert _steps(metrics).count(3) == 2  # lost with the killed run, trained again
    final = load_latest(tmp_path / "ckpt")
    assert final is not None and final.state.version == 6
    assert final.state.groups_trained == 12 and sum(final.state.positions.values()) == 12
    versions = [v.version for v in policy_versions(kafka_config, topics_config.name("policy"))]
    assert versions == [2, 4, 6]
    # what replicas load: one consolidated safetensors directory; the resume state beside it
    assert (tmp_path / "ckpt" / "sharded" / "step-6" / ".metadata").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(final.path))
    assert sum(p.numel() for p in model.parameters()) > 0
