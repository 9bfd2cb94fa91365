"""`rollout up` without `--ray`: every stage a process on this machine, in the foreground, in
each deployment mode (standalone replicas, the lent trainer, the colocated judge pool); it
returns the trainer's exit status once `--steps` are done, and leaves no process behind.
`rollout down --local` stops one from another shell.

Real broker, real `hf` replicas of the tiny model, the real CLI as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pipeline.data.arithmetic import arithmetic_rows
from pipeline.data.producer import PromptProducer
from schemas import decode
from tests.conftest import REPO, ROLLOUT, run_cli
from tests.integration.test_pipeline_e2e import pipeline_config
from tests.integration.test_ray_launch import processes_of
from tests.integration.trainer_helpers import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.long]

STEPS = 2


def write_config(cfg, tmp_path: Path, **sections: dict) -> Path:
    data = cfg.redacted()
    for section, values in sections.items():
        data[section].update(values)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def step_log(cfg) -> list[dict]:
    metrics = Path(cfg.trainer.checkpoint_dir) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.timeout(600)  # the judge's warm start, when this case builds it first
@pytest.mark.parametrize("mode", ["standalone", "lend", "judge"])
def test_up_runs_each_mode_to_its_steps_and_leaves_nothing(
    mode, request, kafka_config, kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    sections: dict[str, dict] = {}
    if mode == "lend":
        # Synchronous, so the next batch is not already waiting when the trainer has stepped
        # (with groups ready it rightly declines to lend: `declined`).
        sections["trainer"] = {"max_staleness": 0, "lend": {"enable": True, "reclaim_ratio": 0.5}}
    if mode == "judge":
        from tests.integration.test_judge import judge_settings

        sections["reward"] = {"judge": judge_settings(request.getfixturevalue("judge_model"))}
    config_file = write_config(cfg, tmp_path, **sections)
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(24, seed=5, max_operand=3), uid_prefix=mode)
    run_dir = tmp_path / "run"

    up = run_cli("--config", str(config_file), "up", "--run", mode, "--model", str(tiny_model),
                 "--run-dir", str(run_dir), "--replicas", "1", "--steps", str(STEPS),
                 "--timeout", "300", timeout=400)  # fmt: skip

    logs = {p.name: p.read_text()[-1500:] for p in (run_dir / "logs").glob("*.log")}
    assert up.returncode == 0, (up.stderr[-1500:], logs.pop("train.log", ""), logs)
    rows = {r["stage"]: r for r in map(json.loads, up.stdout.splitlines())}
    expected = ["agent-loop", "reward", "replay", "train", "replica-0", "sync-0"]
    assert sorted(rows) == sorted(expected + (["judge-0"] if mode == "judge" else []))
    assert all(Path(r["log"]).is_file() for r in rows.values())
    assert f"logs: {run_dir / 'logs'}" in up.stderr
    assert not (run_dir / "up.pid").exists()
    assert (run_dir / "config.yaml").is_file()
    # Every process it started is gone (their process groups too).
    assert processes_of({r["pid"] for r in rows.values()}, str(run_dir / "config.yaml")) == []

    records = step_log(cfg)
    assert [r["step"] for r in records if r["event"] == "step"][-STEPS:] == [1, 2]
    if mode == "lend":  # hybrid: lent (or declined) between the steps, withdrawn before each
        lends = [r for r in records if r["event"] == "lend"]
        assert [r["step"] for r in lends] == [1, 2]
        for record in lends:
            assert record["lends"] + record["declined"] >= record["step"], record
            assert record["withdrawals"] == record["lends"], record
            assert record["tokens_during_steps"] == record["running_at_steps"] == 0, record
        assert lends[-1]["lends"] >= 1, lends  # lent after step 1, before publishing
        lent = [
            r
            for r in read_all(kafka_config, topics_config.name("replicas"), timeout_s=2)
            if r.key.decode().startswith("trainer-lent-")
        ]
        assert lent and lent[-1].value is None, lent  # announced, and withdrawn last
    if mode == "judge":  # every trajectory scored by the judge pool (or its failure score)
        scored = read_all(kafka_config, topics_config.name("scored"), timeout_s=2)
        assert scored
        extras = [decode(record.value).reward_extra for record in scored]
        parsed = [e for e in extras if not e.get("reward_failed")]
        assert all(e["scorer"] == "judge" and e["judge_replicas"] == ["judge-0"] for e in parsed)
        assert parsed, extras[:3]  # the warm-started judge answers in its verdict format
        for extra in extras:
            assert not extra.get("reward_failed") or (
                extra["reward_error_cause"] == "unparseable_verdict"
            ), extra


def test_down_local_stops_a_running_up(
    kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    """`rollout up` with steps it will not reach; `rollout down --local` from another process
    stops it once training started: exit 130, no process left, the pid file gone."""
    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    config_file = write_config(cfg, tmp_path)
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(24, seed=6), uid_prefix="down")
    run_dir = tmp_path / "run"
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        up = subprocess.Popen(
            [*ROLLOUT, "--config", str(config_file), "up", "--run", "down", "--model",
             str(tiny_model), "--run-dir", str(run_dir), "--replicas", "1", "--steps", "1000"],
            cwd=REPO, stdout=out_file, stderr=err_file, text=True,
        )  # fmt: skip
    try:
        metrics = Path(cfg.trainer.checkpoint_dir) / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and up.poll() is None:
            if metrics.exists() and '"event": "step"' in metrics.read_text():
                break
            time.sleep(1.0)
        assert up.poll() is None, err_path.read_text()[-3000:]
        assert (run_dir / "up.pid").read_text().strip() == str(up.pid)

        down = run_cli("down", "--local", "--run-dir", str(run_dir), timeout=120)
        assert down.returncode == 0, (down.stderr, err_path.read_text()[-3000:])
        assert "stopped" in down.stdout
        up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 130, err_path.read_text()[-3000:]
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert processes_of({r["pid"] for r in rows}, str(run_dir / "config.yaml")) == []
    assert not (run_dir / "up.pid").exists()
    again = run_cli("down", "--local", "--run-dir", str(run_dir), timeout=60)
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
