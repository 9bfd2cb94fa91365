"""`examples/own_trainer.py`, the README's client example, runs against the real broker: it
reads whole groups, saves its positions, and a second run resumes exactly after them; with
`--model` it trains and its versions reach the replicas through `PolicyPublisher`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pipeline.clients import PromptProducer
from pipeline.data.arithmetic import arithmetic_rows
from pipeline.launch.local import LocalPipeline
from tests.conftest import REPO
from tests.integration.test_pipeline_e2e import pipeline_config, served_version
from tests.integration.test_trajectory_consumer import _group
from tests.integration.trainer_helpers import produce

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def run_example(bootstrap: str, prefix: str, state: str) -> dict:
    done = subprocess.run(
        [
            sys.executable, "examples/own_trainer.py", "--bootstrap", bootstrap,
            "--set", f"topics.prefix={prefix}", "--state", state, "--batch", "4", "--wait", "3",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_client_example_reads_checkpoints_and_resumes(
    kafka_config, kafka_bootstrap, topics_config, tmp_path
) -> None:
    replay = topics_config.name("replay")
    produce(kafka_config, replay, [_group(f"g{i}") for i in range(6)])
    state = str(tmp_path / "state.json")
    first = run_example(kafka_bootstrap, topics_config.prefix, state)
    assert (first["steps"], first["groups"]) == (2, 6)  # 4 groups, then the last 2
    assert sum(first["positions"].values()) == 6
    again = run_example(kafka_bootstrap, topics_config.prefix, state)
    assert (again["steps"], again["groups"]) == (2, 6)  # nothing new: nothing read twice
    produce(kafka_config, replay, [_group(f"h{i}") for i in range(3)])
    last = run_example(kafka_bootstrap, topics_config.prefix, state)
    assert (last["steps"], last["groups"]) == (3, 9)
    assert sum(last["positions"].values()) == 9


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("weight_transfer", ["disk", "broadcast"])
def test_the_example_trains_and_the_replicas_serve_its_versions(
    kafka_bootstrap, topics_config, tiny_model, tmp_path, weight_transfer
) -> None:
    """The pipeline without its own trainer; `examples/own_trainer.py --model` trains 3 steps
    with a plain PyTorch update and publishes each version through `PolicyPublisher`, by
    checkpoint and by broadcast: the replica serves the example's last version."""
    cfg = pipeline_config(
        kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1, weight_transfer
    )
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(16, seed=9), uid_prefix=f"own-{weight_transfer}")
    run_dir = tmp_path / "run"
    stages = ("agent-loop", "reward", "replay")
    with LocalPipeline(cfg, run_dir, model_dir=str(tiny_model), replicas=1, stages=stages) as pipe:
        example = subprocess.run(
            [sys.executable, "examples/own_trainer.py", "--config", str(run_dir / "config.yaml"),
             "--state", str(tmp_path / "state.json"), "--batch", "2", "--wait", "120",
             "--model", str(tiny_model), "--out", str(tmp_path / "mine"), "--steps", "3",
             "--lr", "1e-3"],
            cwd=REPO, capture_output=True, text=True, timeout=400, check=False,
        )  # fmt: skip
        pipe.check()
        assert example.returncode == 0, example.stderr[-3000:]
        state = json.loads(example.stdout.splitlines()[-1])
        assert (state["steps"], state["published"]) == (3, 3)
        for _ in range(60):
            if served_version(pipe.replica_urls[0]) == 3:
                break
            time.sleep(1.0)
        assert served_version(pipe.replica_urls[0]) == 3
    if weight_transfer == "disk":
        assert (tmp_path / "mine" / "step-3" / "model.safetensors").is_file()
    else:
        assert not (tmp_path / "mine").exists()  # no disk: the weights went over the group
