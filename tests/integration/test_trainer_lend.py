"""Hybrid lending on the real broker with real replicas: the idle trainer serves generation
from its live model, withdraws before every step, and what it was running resumes elsewhere.

Every stage its own process (`LocalPipeline`), one standalone `hf` replica and the trainer's
lent one; responses run to `max_tokens` so a withdrawal finds generations mid-way."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.clients import PromptProducer
from pipeline.config import load_config
from pipeline.data.arithmetic import arithmetic_rows
from pipeline.launch.local import LocalPipeline
from schemas.codec import decode
from schemas.events import ScoredTrajectory, TrainingGroup
from tests.integration.trainer_helpers import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.long]

STEPS = 4
BATCH = 4
MAX_TOKENS = 256


def lend_config(bootstrap: str, prefix: str, model: Path, run_dir: Path):
    return load_config(
        None,
        {
            "kafka": {"bootstrap_servers": bootstrap},
            "topics": {"prefix": prefix},
            "agent_loop": {
                "group_id": f"{prefix}agent-loop",
                "model": str(model),
                "n": 2,
                # Half a batch at once: the batch generates in two waves, and the reclaim
                # (one group ready) finds the second wave mid-way.
                "max_samples_in_flight": BATCH,
                "commit_interval_s": 0.5,
                # Long enough that the second wave is still decoding when the first wave's
                # group has been scored and grouped (the reclaim): with 64 tokens (24 before)
                # the second wave sometimes finished first, and no withdrawal cut anything.
                "sampling": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True},
                "llm": {"health_interval_s": 1.0},
            },
            "reward": {
                "group_id": f"{prefix}reward",
                "tokenizer": str(model),
                "batch_within_s": 0.1,
                "commit_interval_s": 0.5,
            },
            "replay": {
                "group_id": f"{prefix}replay",
                "n": 2,
                "batch_within_s": 0.1,
                "commit_interval_s": 0.5,
            },
            "trainer": {
                "model_dir": str(model),
                "checkpoint_dir": str(run_dir / "ckpt"),
                "group_id": f"{prefix}trainer",
                "train_batch_size": BATCH,
                "sync_every": 1,
                "max_steps": STEPS,
                # Synchronous: the next batch is admitted only once the trainer publishes, so
                # no groups wait when it has stepped and it lends (with groups waiting it
                # declines, and a run whose generation got ahead of the trainer lent nothing).
                "max_staleness": 0,
                "torch_threads": 1,
                "lr": 1e-3,
                # Back after one group of four: the second wave is mid-way, on both engines.
                "lend": {"enable": True, "reclaim_ratio": 0.25},
            },
        },
    )


def replay_samples(cfg) -> dict[str, ScoredTrajectory]:
    records = read_all(cfg.kafka, cfg.topics.name("replay"), timeout_s=2.0)
    groups = [e for e in (decode(r.value) for r in records) if isinstance(e, TrainingGroup)]
    return {s.trajectory_id: s for g in groups for s in g.samples}


def test_lent_trainer_serves_withdraws_and_its_generations_resume_elsewhere(
    kafka_config, kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    cfg = lend_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path)
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(40, seed=3), uid_prefix="lend")
    metrics = tmp_path / "ckpt" / "metrics.jsonl"
    with LocalPipeline(cfg, tmp_path / "run", model_dir=str(tiny_model), replicas=1) as pipe:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and pipe.process("train").proc.poll() is None:
            pipe.check()
            time.sleep(1.0)
        train = pipe.process("train")
        assert train.proc.poll() == 0, train.tail()
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        cut = {rid: v for r in rows if r["event"] == "lend" for rid, v in r["aborted_with_tokens"]}
        # The stages run on: the generations the withdrawals cut off finish on the replica.
        samples = replay_samples(cfg)
        while time.monotonic() < deadline and not set(cut) <= set(samples):
            pipe.check()
            time.sleep(2.0)
            samples = replay_samples(cfg)
    steps = [r for r in rows if r["event"] == "step"]
    lends = [r for r in rows if r["event"] == "lend"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [r["step"] for r in lends] == list(range(1, STEPS + 1))

    last = lends[-1]
    assert last["completions"] > 0 and last["generated_tokens"] > 0, last  # it served
    before = {"lends": 0, "declined": 0}
    for record in lends:  # withdrawn before every step, nothing ran while it trained
        assert record["state"] == "withdrawn", record
        # Each collection lent (or declined: its group already waited on the topic), at the
        # trainer's version: right after the step before, so the version is this step's - 1.
        lent = record["lends"] - before["lends"]
        declined = record["declined"] - before["declined"]
        assert lent in (0, 1) and declined in (0, 1) and lent + declined >= 1, (record, before)
        assert record["withdrawals"] == record["lends"], record
        assert record["tokens_during_steps"] == 0 and record["running_at_steps"] == 0, record
        if lent:
            assert record["version"] == record["step"] - 1, record
        before = record
    assert last["lends"] >= 1, last

    # Pieces a withdrawal cut off after they sampled tokens at version v: each generation was
    # finished elsewhere (no replica other than the standalone one serves after the
    # withdrawal) and reached rl.replay with v inside its [min, max]_global_steps.
    assert cut, "no withdrawal found a generation mid-way; lending proved nothing"
    assert set(cut) <= set(samples), sorted(set(cut) - set(samples))
    trained = Counter(t for s in steps for t in s["trajectory_ids"])
    assert all(n == 1 for n in trained.values()), trained.most_common(3)  # trained once each
    for rid in cut:
        extra = samples[rid].extra_fields
        assert extra.min_global_steps <= cut[rid] <= extra.max_global_steps, (rid, cut[rid], extra)
        assert len(samples[rid].response_ids) == MAX_TOKENS  # resumed to the full budget
