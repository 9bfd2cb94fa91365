"""A real stage process serves its metrics: `rollout worker reward --metrics-port P`.

Turn events (two complete trajectories and one undecodable record) go to the test's own
`rl.turns`; the worker is the real CLI subprocess against the real broker; the test scrapes
`/metrics` until the stage has counted them, and checks names, labels and values.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas.codec import encode, headers_for
from schemas.events import ExtraFields, RewardModelSpec, TurnEvent
from tests.conftest import REPO, free_port
from workers.kafka.clients import make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from pipeline.harness.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    tok = build_tokenizer()
    tok.save_pretrained(path)
    return path, tok


def _turns(tok: Any, uid: str, answer: str) -> list[TurnEvent]:
    """A two-turn gsm8k trajectory (assistant, then a final assistant turn)."""
    events = []
    for index, text in enumerate(["let me think", f"#### {answer}"]):
        ids = tok.encode(text)
        first, final = index == 0, index == 1
        events.append(
            TurnEvent(
                trajectory_id=f"{uid}/0",
                uid=uid,
                sample_index=0,
                attempt_id="a",
                turn_index=index,
                role="assistant",
                token_ids=ids,
                logprobs=[-0.1] * len(ids),
                min_global_steps=0,
                max_global_steps=0,
                final=final,
                prompt_ids=tok.encode("question?") if first else None,
                data_source="openai/gsm8k" if first else None,
                reward_model=RewardModelSpec(ground_truth="4") if first else None,
                num_turns=3 if final else None,
                extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0) if final else None,
            )
        )
    return events


@pytest.fixture
def reward_process(
    tmp_path: Path,
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    tokenizer: tuple[Path, Any],
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "kafka": {"bootstrap_servers": kafka_config.bootstrap},
                "topics": {"prefix": topics_config.prefix},
                "reward": {
                    "group_id": f"{topics_config.prefix}reward",
                    "tokenizer": str(tokenizer[0]),
                    "session_timeout_s": 6,
                    "commit_interval_s": 1.0,
                    "pool_workers": 1,
                },
            }
        )
    )
    port = free_port()
    log = tmp_path / "reward.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline.cli.main",
                "--config",
                str(config),
                "-v",
                "worker",
                "reward",
                "--metrics-port",
                str(port),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None  # not serving yet
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_reward_worker_serves_its_counters(
    reward_process: tuple[subprocess.Popen[bytes], int, Path],
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    tokenizer: tuple[Path, Any],
) -> None:
    proc, port, log = reward_process
    turns, scored, dlq = (topics_config.name(r) for r in ("turns", "scored", "dlq"))
    events = [*_turns(tokenizer[1], "m1", "4"), *_turns(tokenizer[1], "m2", "5")]
    producer = make_producer(kafka_config)
    try:
        for event in events:
            producer.send(
                turns, key=event.trajectory_id, value=encode(event), headers=headers_for(event)
            )
        producer.send(turns, key="junk", value=b"\x00 not an event")
        producer.flush(timeout=30)
    finally:
        producer.close()

    def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return name, frozenset({"stage": "reward", **labels}.items())

    consumed = key("rollout_messages_consumed_total", topic=turns)
    produced = key("rollout_messages_produced_total", topic=scored)
    samples: dict[Any, float] | None = None
    # The worker's own start (tokenizer, the group join, the table restore) dominates: seconds on an
    # idle machine, up to a minute on a loaded one.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        samples = _scrape(port)
        if samples and samples.get(consumed, 0) >= 5 and samples.get(produced, 0) >= 2:
            break
        time.sleep(0.5)
    assert samples is not None, f"/metrics never answered:\n{log.read_text()[-3000:]}"
    assert samples.get(consumed) == 5, log.read_text(errors="replace")[-3000:]
    assert samples.get(produced) == 2
    assert samples[key("rollout_messages_produced_total", topic=dlq)] == 1
    assert samples[key("rollout_dead_letters_total", reason="DecodeError")] == 1
    assert samples[key("rollout_trajectory_latency_seconds_count")] == 2
    assert samples[key("rollout_in_flight_samples")] == 0  # both trajectories finished
