"""`rollout up` on a machine with GPUs (a fake count, `--gpus`): every process sees only its
own GPUs, and `rollout down` leaves no process of the run, vLLM's included.

Real broker, the real CLI as subprocesses; vLLM is `stub_vllm.py` (it ignores SIGTERM, in a
session of its own with an engine child, as a vLLM that holds its GPUs does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.data.arithmetic import arithmetic_rows
from pipeline.data.producer import PromptProducer
from pipeline.launch.foreground import running
from tests.conftest import REPO, ROLLOUT, run_cli
from tests.integration.test_pipeline_e2e import pipeline_config
from tests.integration.test_up_local import write_config

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STUB = Path(__file__).with_name("stub_vllm.py")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def _stub_python(tmp_path: Path) -> Path:
    python = tmp_path / "vllm-python"
    python.write_text(f"#!{sys.executable}\n" + STUB.read_text())
    python.chmod(0o755)
    return python


@pytest.mark.timeout(300)
def test_up_gives_each_process_its_gpus_and_down_leaves_no_process(
    kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    config_file = write_config(
        cfg, tmp_path, vllm={"python": str(_stub_python(tmp_path))}, trainer={"device": "auto"}
    )
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(4, seed=7), uid_prefix="gpus")
    run_dir, stubs = tmp_path / "run", tmp_path / "stubs"
    stubs.mkdir()
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    env = {**os.environ, "STUB_VLLM_DIR": str(stubs)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        up = subprocess.Popen(
            [*ROLLOUT, "--config", str(config_file), "up", "--run", "gpus", "--model",
             str(tiny_model), "--run-dir", str(run_dir), "--replicas", "2", "--backend", "vllm",
             "--gpus", "3", "--grace", "3", "--steps", "1000"],
            cwd=REPO, stdout=out_file, stderr=err_file, text=True, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and up.poll() is None:
            if len(list(stubs.glob("*.json"))) == 2 and "is up" in err_path.read_text():
                break
            time.sleep(0.5)
        assert up.poll() is None, err_path.read_text()[-3000:]
        rows = {r["stage"]: r for r in map(json.loads, out_path.read_text().splitlines())}
        seen = {
            name: _environ(row["pid"]).get("CUDA_VISIBLE_DEVICES") for name, row in rows.items()
        }
        stub_rows = [json.loads(p.read_text()) for p in stubs.glob("*.json")]

        down = run_cli("down", "--run-dir", str(run_dir), timeout=120)
        assert down.returncode == 0, (down.stderr, err_path.read_text()[-3000:])
        up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    # Two replicas of one GPU each and the trainer on the third: disjoint; the rest none.
    assert seen.pop("replica-0") == "0" and seen.pop("replica-1") == "1", seen
    assert seen.pop("train") == "2", seen
    assert seen and set(seen.values()) == {""}, seen
    assert sorted(s["gpus"] for s in stub_rows) == ["0", "1"], stub_rows  # vLLM's own
    assert all(s["sid"] == s["pid"] for s in stub_rows)  # in sessions of their own
    # No process of the run is left: the stages, and vLLM's with its engine child.
    pids = [r["pid"] for r in rows.values()] + [p for s in stub_rows for p in (s["pid"], s["core"])]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if running(p)]
    for pid in left:  # the test's own stubs: never left running, whatever it found
        os.kill(pid, signal.SIGKILL)
    assert left == [], stub_rows


def test_up_refuses_replicas_that_do_not_fit_in_one_line(
    kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    config_file = write_config(cfg, tmp_path, vllm={"python": str(_stub_python(tmp_path))})
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(2, seed=8), uid_prefix="fit")
    up = run_cli("--config", str(config_file), "up", "--model", str(tiny_model), "--run-dir",
                 str(tmp_path / "run"), "--replicas", "2", "--backend", "vllm", "--tp", "2",
                 "--gpus", "3", "--steps", "1", env={"STUB_VLLM_DIR": str(tmp_path)})  # fmt: skip
    assert up.returncode == 1, up.stderr
    last = up.stderr.strip().splitlines()[-1]
    assert "do not fit this machine's 3 GPUs" in last, up.stderr
    assert "Traceback" not in up.stderr
    assert not list(tmp_path.glob("run/logs/*.log"))  # refused before any process started
