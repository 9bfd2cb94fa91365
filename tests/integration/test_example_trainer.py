"""`examples/own_trainer.py`, the README's client example, runs against the real broker: it
reads whole groups, saves its positions, and a second run resumes exactly after them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
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
