"""Kill -9 the agent-loop worker mid-run, start another: no sample is lost."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from schemas import PromptEvent, decode
from tests.conftest import REPO
from tests.integration.agent_helpers import (
    TurnReader,
    finals_by_sample,
    produce_prompts,
    read_turns,
)
from tests.integration.trainer_helpers import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def start_worker(kafka_bootstrap, topics, model, replicas, group, log) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "pipeline.cli.main", "-v", "--bootstrap", kafka_bootstrap,
        "--set", f"topics.prefix={topics.prefix}",
        "--set", f"agent_loop.group_id={group}",
        "--set", "agent_loop.n=2",
        "--set", "agent_loop.sampling.max_tokens=48",
        # Few at a time, so the run is long enough that the kill lands mid-run on a busy machine.
        "--set", "agent_loop.max_samples_in_flight=2",
        "--set", "agent_loop.commit_interval_s=0.5",
        "worker", "agent-loop", "--model", str(model),
    ]  # fmt: skip
    for rep in replicas:
        args += ["--replica", rep.address]
    return subprocess.Popen(args, cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def test_kill_9_mid_run_loses_nothing(
    kafka_config, kafka_bootstrap, topics_config, tiny_model, hf_replicas, unique, tmp_path
) -> None:
    prompts = [
        PromptEvent(
            uid=f"k-{i}",
            prompt=[{"role": "user", "content": f"What is {i} + {i}?"}],
            data_source="openai/gsm8k",
        )
        for i in range(16)
    ]
    produce_prompts(kafka_config, topics_config.name("prompts"), prompts)
    expected = {(p.uid, i) for p in prompts for i in range(2)}
    group = unique("al-kill")
    log = tmp_path / "worker.log"

    # The reader has its partitions before the worker starts, and the worker is killed at
    # the first completed sample it sees.
    first = None
    try:
        with TurnReader(kafka_config, topics_config.name("turns")) as reader:
            first = start_worker(
                kafka_bootstrap, topics_config, tiny_model, hf_replicas, group, log
            )
            reader.read(
                until=lambda ts: bool(finals_by_sample(ts)) or first.poll() is not None,
                timeout_s=180,
            )
            assert finals_by_sample(reader.turns), log.read_text()[-3000:]
    finally:
        if first is not None:
            first.kill()  # SIGKILL, mid-run
    first.wait()
    # What the first worker had finished is what is on the topic now, not what the reader saw.
    turns = [decode(r.value) for r in read_all(kafka_config, topics_config.name("turns"))]
    done_before = len(finals_by_sample(turns))
    assert 1 <= done_before < len(expected), (
        f"the kill must land mid-run\n{log.read_text()[-3000:]}"
    )

    started_at = log.stat().st_size
    second = start_worker(kafka_bootstrap, topics_config, tiny_model, hf_replicas, group, log)
    try:
        turns = read_turns(
            kafka_config,
            topics_config.name("turns"),
            until=lambda ts: set(finals_by_sample(ts)) >= expected,
            timeout_s=240,
        )
        # The first worker may have finished more than the reader had seen when it was
        # killed: let the second one get through its start (a SIGTERM while Python is still
        # importing is a plain kill), so what is checked below is its graceful stop.
        deadline = time.monotonic() + 120
        while "assigned" not in log.read_bytes()[started_at:].decode(errors="replace"):
            assert time.monotonic() < deadline and second.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(timeout=60)
        except subprocess.TimeoutExpired:
            second.kill()
    finals = finals_by_sample(turns)
    assert set(finals) == expected, f"missing: {expected - set(finals)}\n{log.read_text()[-3000:]}"
    for attempts in finals.values():
        assert len(attempts) == len(set(attempts)), "a duplicate must carry a new attempt_id"
    assert second.returncode == 0, log.read_text()[-3000:]
    print(
        f"finished before the kill: {done_before}; "
        f"redone after: {sum(len(a) - 1 for a in finals.values())}"
    )
