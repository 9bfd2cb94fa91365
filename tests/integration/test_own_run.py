"""A user's own run, start to finish, as a new user takes it right after the demo: their
dataset through `rollout produce` and `rollout up`, under one topic prefix, then another, then
the first again; what came out read back as text; bad rows refused before any compute.

Real broker, real `hf` replicas of the tiny model, the real CLI as subprocesses started in a
directory of the user's own (not the checkout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from pipeline.data.arithmetic import arithmetic_rows, write_rows
from pipeline.topics import create_topics
from tests.conftest import REPO
from tests.integration.trainer_helpers import read_all
from workers.kafka.clients import make_consumer
from workers.kafka.config import TopicsConfig

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STEPS = 2


def rollout_in(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`rollout …` as a user types it in `cwd` (the checkout only on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False,
    )  # fmt: skip


def one_error_line(run: subprocess.CompletedProcess[str]) -> str:
    shown = f"exit {run.returncode}:\n{run.stderr[-3000:]}"
    assert run.returncode != 0, shown
    assert "Traceback" not in run.stderr + run.stdout, shown
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rollout: "), shown
    return lines[0]


@pytest.fixture
def user_dir(tmp_path: Path, kafka_bootstrap: str) -> Path:
    """A directory of the user's own with their dataset and a small config (no tokenizer, no
    group ids, no checkpoint directory: what `rollout up` derives is under test)."""
    work = tmp_path / "work"
    work.mkdir()
    write_rows(arithmetic_rows(24, seed=3, max_operand=3), work / "mygsm.jsonl")
    config = {
        "kafka": {"bootstrap_servers": kafka_bootstrap},
        "agent_loop": {"n": 2, "sampling": {"max_tokens": 8}, "commit_interval_s": 0.5},
        "replay": {"n": 2, "batch_within_s": 0.1, "commit_interval_s": 0.5},
        "reward": {"batch_within_s": 0.1, "commit_interval_s": 0.5},
        "trainer": {"train_batch_size": 4, "torch_threads": 1},
    }
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    return work


@pytest.mark.long
@pytest.mark.timeout(900)
def test_one_dataset_under_two_prefixes_then_the_first_again(
    user_dir, kafka_config, tiny_model, unique
) -> None:
    """Each prefix is its own run: its trajectories are scored and trained, its checkpoints
    kept apart (the second run lost every trajectory to the first's changelog, and a third
    resumed the first's checkpoints and trained 0 steps, exiting 0). `up --model` alone
    gives the tokenizer to every stage, shows each step and ends with the report."""
    runs = [unique("own").replace("-", "") for _ in range(2)]
    for run in runs:
        flags = ("--config", "run.yaml", "--set", f"topics.prefix={run}.")
        produced = rollout_in(user_dir, *flags, "produce", "--dataset", "mygsm.jsonl", "--quiet")
        assert produced.returncode == 0, produced.stderr
        up = rollout_in(user_dir, *flags, "up", "--model", str(tiny_model), "--steps",
                        str(STEPS), "--replicas", "1", "--timeout", "400", timeout=500)  # fmt: skip
        run_dir = user_dir / "runs" / run
        logs = {p.name: p.read_text()[-1500:] for p in (run_dir / "logs").glob("*.log")}
        assert up.returncode == 0, (up.stderr[-2000:], logs)
        assert f"24 prompts wait on {run}.prompts: at most 6 steps of 4 groups" in up.stderr
        lines = up.stderr.splitlines()
        progress = [line for line in lines if line.startswith("step ")]
        assert [line.split()[1] for line in progress] == ["1/2", "2/2"], up.stderr
        assert all("reward " in line and "staleness " in line for line in progress)
        assert any(line.startswith("reward_last_10pct ") for line in lines), up.stderr
        assert (run_dir / "report" / "report.png").is_file()
        summary = json.loads((run_dir / "report" / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * 4 * 2
        assert (run_dir / "checkpoints" / f"step-{STEPS}").is_dir()  # in the user's directory
        assert not (REPO / "runs" / run).exists() and not (REPO / "checkpoints").exists()
        scored = read_all(kafka_config, f"{run}.scored", timeout_s=2)
        assert len(scored) >= STEPS * 4 * 2  # every trained sample was scored in this run
    # The first prefix again, to the steps it has: refused in one line before any stage.
    again = rollout_in(user_dir, "--config", "run.yaml", "--set", f"topics.prefix={runs[0]}.",
                       "up", "--model", str(tiny_model), "--steps", str(STEPS))  # fmt: skip
    line = one_error_line(again)
    assert f"run {runs[0]} is done" in line and f"--steps above {STEPS} continues it" in line
    assert '"stage"' not in again.stdout  # nothing was started
    # What came out, as text, as the README says it: no --tokenizer, so the run's (the model
    # `up` was given, read from the config it saved in runs/<run>/).
    shown = rollout_in(user_dir, "--config", "run.yaml", "--set", f"topics.prefix={runs[1]}.",
                       "consume", "--topic", "scored", "--limit", "1", "--decode")  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    event = json.loads(shown.stdout.splitlines()[0])
    assert event["prompt_text"].count("<|im_start|>") >= 2  # the chat template's turns
    assert isinstance(event["response_text"], str) and event["response_text"]


def test_a_row_its_scorer_cannot_score_is_refused_at_produce(
    user_dir, kafka_config, unique
) -> None:
    """A gsm8k row without a ground truth, or of a data source no scorer knows, is refused
    with its line number (from 1) before it is produced; `--allow-unscorable` sends it."""
    rows = arithmetic_rows(3, seed=4)
    rows[1]["reward_model"] = {"style": "rule"}  # line 2: no ground truth
    rows[2]["data_source"] = "my/own"  # line 3: no scorer
    write_rows(rows, user_dir / "bad.jsonl")
    prefix = f"{unique('unscorable')}."
    flags = ("--config", "run.yaml", "--set", f"topics.prefix={prefix}")
    run = rollout_in(user_dir, *flags, "produce", "--dataset", "bad.jsonl", "--quiet")
    assert run.returncode == 0, run.stderr
    assert "skipped row 2: the gsm8k scorer needs reward_model.ground_truth" in run.stderr
    assert "skipped row 3: no scorer for data_source 'my/own'" in run.stderr
    assert json.loads(run.stdout.splitlines()[-1])["sent"] == 1
    assert len(read_all(kafka_config, f"{prefix}prompts", timeout_s=2)) == 1
    sent = rollout_in(user_dir, *flags, "produce", "--dataset", "bad.jsonl", "--quiet",
                      "--allow-unscorable")  # fmt: skip
    assert json.loads(sent.stdout.splitlines()[-1])["sent"] == 3, sent.stderr


def test_a_stage_refuses_a_group_that_served_another_runs_topics(
    user_dir, kafka_config, tiny_model, unique
) -> None:
    """A reward group named by hand for two runs: its changelog holds the first run's
    trajectories and would drop the second's as already scored. The stage refuses in one
    line instead of waiting silently."""
    first, second = TopicsConfig(prefix=f"{unique('a')}."), TopicsConfig(prefix=f"{unique('b')}.")
    for topics in (first, second):
        create_topics(kafka_config, topics)
    group = unique("shared-reward")
    consumer = make_consumer(kafka_config, group_id=group, name="test-commit")
    try:
        tp = TopicPartition(first.name("turns"), 0)
        consumer.assign([tp])
        consumer.commit({tp: OffsetAndMetadata(0, "", -1)})
    finally:
        consumer.close()
    run = rollout_in(user_dir, "--config", "run.yaml", "--set", f"topics.prefix={second.prefix}",
                     "--set", f"reward.group_id={group}", "worker", "reward",
                     "--tokenizer", str(tiny_model), timeout=60)  # fmt: skip
    line = one_error_line(run)
    assert f"consumer group {group} already consumed {first.name('turns')}" in line
    assert "leave the stage's group_id unset" in line


@pytest.mark.long
def test_a_warm_start_learns_from_the_users_dataset(user_dir, tmp_path) -> None:
    """`rollout model init --warm-start DATASET`: the demo's warm start on the user's rows;
    a dataset without one ground truth is one line, before a model is built."""
    made = rollout_in(user_dir, "model", "init", "--out", str(tmp_path / "m"), "--warm-start",
                      "mygsm.jsonl", timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    assert "warm start: 400 supervised steps on 24 rows of mygsm.jsonl" in made.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()
    rows = arithmetic_rows(2, seed=1)
    for row in rows:
        row["reward_model"] = {"style": "rule"}
    write_rows(rows, user_dir / "none.jsonl")
    refused = rollout_in(user_dir, "model", "init", "--out", str(tmp_path / "n"),
                         "--warm-start", "none.jsonl")  # fmt: skip
    assert "no row with a text prompt and reward_model.ground_truth" in one_error_line(refused)
    assert not (tmp_path / "n").exists()
