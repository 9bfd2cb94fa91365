"""A prompt's identity on the whole path (agent loop, reward, replay as processes): datasets
whose files share a name all reach `rl.replay`; a file produced twice is de-duplicated; a uid
produced again for another prompt is dead-lettered as `duplicate_uid`, never merged or lost."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.clients import PromptProducer
from pipeline.config import load_config
from pipeline.data.arithmetic import arithmetic_rows
from pipeline.launch.local import LocalPipeline
from schemas.codec import decode
from schemas.events import ChatMessage, PromptEvent, TrainingGroup
from schemas.headers import DLQ_PREFIX
from tests.conftest import run_cli
from tests.integration.trainer_helpers import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

N = 2  # samples per prompt


def write_dataset(path: Path, seed: int) -> list[str]:
    """Four verl rows without uids (so the producer names them) at `path`; their questions."""
    path.parent.mkdir(parents=True)
    rows = [{k: v for k, v in r.items() if k != "uid"} for r in arithmetic_rows(4, seed=seed)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["prompt"][0]["content"] for r in rows]


def produce(flags: list[str], dataset: Path) -> None:
    done = run_cli(*flags, "produce", "--dataset", str(dataset), "--quiet")
    assert done.returncode == 0, done.stderr


def test_same_named_datasets_both_reach_replay_and_a_reused_uid_is_a_dead_letter(
    kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    prefix = topics_config.prefix
    cfg = load_config(
        None,
        {
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "topics": {"prefix": prefix},
            "agent_loop": {
                "group_id": f"{prefix}agent-loop",
                "model": str(tiny_model),
                "n": N,
                "commit_interval_s": 0.5,
                "sampling": {"max_tokens": 8},
                "llm": {"health_interval_s": 1.0},
            },
            "reward": {"group_id": f"{prefix}reward", "tokenizer": str(tiny_model)},
            "replay": {"group_id": f"{prefix}replay", "n": N, "batch_within_s": 0.1},
            "trainer": {"max_staleness": None},  # no trainer here: the gate must not wait
        },
    )
    flags = ["--bootstrap", kafka_bootstrap, "--set", f"topics.prefix={prefix}"]
    a, b = tmp_path / "gsm8k" / "train.jsonl", tmp_path / "math" / "train.jsonl"
    questions = write_dataset(a, seed=1) + write_dataset(b, seed=2)
    assert len(set(questions)) == 8
    produce(flags, a)
    produce(flags, b)
    produce(flags, a)  # the same file again: the same uids, de-duplicated downstream

    replay = topics_config.name("replay")
    stages = ("agent-loop", "reward", "replay")
    with LocalPipeline(
        cfg, tmp_path / "run", model_dir=str(tiny_model), replicas=1, stages=stages
    ) as pipe:
        groups = _wait_for(lambda: _groups(cfg.kafka, replay), 8, pipe)
        assert len(groups) == 8, sorted(groups)  # both files' prompts, each group once
        asked = {g.samples[0].uid: g for g in groups.values()}
        assert all(len(g.samples) == N for g in asked.values())
        reused = sorted(asked)[0]
        with PromptProducer(cfg.kafka, cfg.topics) as producer:
            producer.send(
                PromptEvent(
                    uid=reused,
                    prompt=[ChatMessage(role="user", content="What is 100 + 1?")],
                    data_source="openai/gsm8k",
                )
            )
        letters = _wait_for(lambda: _letters(cfg.kafka, topics_config.name("dlq")), N, pipe)
        time.sleep(2.0)  # anything that would still arrive late
        assert len(_groups(cfg.kafka, replay)) == 8
        letters = _letters(cfg.kafka, topics_config.name("dlq"))
    assert [(s, c) for s, c, _ in letters] == [("reward", "duplicate_uid")] * N
    assert all(reused in message for _, _, message in letters)
    uids = {uid.rsplit("-", 1)[0] for uid in asked}
    assert len(uids) == 2 and all(u.startswith("train-") for u in uids)  # two datasets


def _groups(kafka, topic) -> dict[str, TrainingGroup]:
    return {g.uid: g for g in (decode(r.value) for r in read_all(kafka, topic, timeout_s=1.0))}


def _letters(kafka, topic) -> list[tuple[str, str, str]]:
    out = []
    for record in read_all(kafka, topic, timeout_s=1.0):
        own = {k: bytes(v).decode() for k, v in record.headers}
        stage, cause = own[DLQ_PREFIX + "stage"], own[DLQ_PREFIX + "error.cause"]
        out.append((stage, cause, own[DLQ_PREFIX + "error.message"]))
    return out


def _wait_for(read, count: int, pipe: LocalPipeline, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pipe.check()
        got = read()
        if len(got) >= count:
            return got
        time.sleep(1.0)
    return read()
