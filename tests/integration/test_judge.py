"""The LLM judge (`reward.judge`) on replicas of its own: real broker, real hf replicas.

A policy replica of the tiny model and a judge replica of the warm-started judge model
(`judge_model`) both register on `rl.replicas`, the judge with role `judge`, as the local
launcher starts them from the config. In two phases:

1. the agent loop generates every trajectory: the policy's router never sends the judge a
   request (its completions counter stays 0) although it is registered and healthy; a new
   policy version reaches the policy replica through its sync controller, and never the
   judge (a controller pointed at it refuses in one line; the judge refuses the post itself);
2. the reward stage scores them through `reward.judge`: one judge request per trajectory, its
   verdict (`Verdict: 0|1`) parsed into the score; the prompts whose reference answer is `?`,
   which the judge was taught to refuse, get the judge's failure score, tagged
   `unparseable_verdict`, counted in the stage's stats and metrics and by `rollout status`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import load_config
from pipeline.data.arithmetic import arithmetic_rows
from pipeline.data.producer import PromptProducer
from pipeline.harness.demo.judge import UNJUDGEABLE
from pipeline.launch.local import REPO, LocalPipeline, spawn_logged
from schemas import decode, encode
from schemas.events import PolicyVersion
from schemas.headers import REWARD_FAILURE
from tests.conftest import JUDGE_TEMPLATE, ROLLOUT, run_cli
from tests.integration.trainer_helpers import read_all
from workers.kafka.clients import make_producer
from workers.ports import free_port

# The judge's warm start (a session fixture) lands in whichever test comes first: on two busy
# cores that test has taken up to 280 s of the 300 s default, so these get a hang guard of 600.
pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]

N = 2  # samples per prompt
JUDGED, UNSURE = 5, 2  # prompts with a reference answer, and with `?`
TRAJECTORIES = (JUDGED + UNSURE) * N
FAILURE_SCORE = -1.0


def judge_settings(judge_model: Path, **more: object) -> dict[str, object]:
    """`reward.judge` for the warm-started judge (its template, a verdict fits 16 tokens)."""
    return {
        "enable": True,
        "model": str(judge_model),
        "template": JUDGE_TEMPLATE,
        "max_tokens": 16,
        "failure_score": FAILURE_SCORE,
        "llm": {"health_interval_s": 1.0},
        **more,
    }


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def completions(url: str) -> float:
    """What the replica's `/metrics` counts as completions answered."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "rollout_replica_completions":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError(f"no rollout_replica_completions at {url}/metrics")


def verdict_counts(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "rollout_judge_verdicts"
        for s in family.samples
        if s.name.endswith("_total")
    }


def wait_for(
    what: str, check: Callable[[], Any], timeout_s: float, pipe: LocalPipeline | None = None
) -> Any:
    """`check()` once it is truthy, polled every second (and the pipeline's processes
    checked alive); the test fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pipe is not None:
            pipe.check()
        value = check()
        if value:
            return value
        time.sleep(1.0)
    pytest.fail(f"timed out waiting for {what}")


def test_the_judge_scores_through_reward_judge_and_the_policy_never_reaches_it(
    kafka_config, kafka_bootstrap, topics_config, tiny_model, judge_model, tmp_path
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
                "sampling": {"max_tokens": 8, "temperature": 1.0},
                "llm": {"health_interval_s": 1.0},
            },
            "reward": {
                "group_id": f"{prefix}reward",
                "tokenizer": str(tiny_model),
                "batch_within_s": 0.1,
                "commit_interval_s": 0.5,
                "stats_path": str(tmp_path / "reward-stats.json"),
                "judge": judge_settings(judge_model),
            },
        },
    )
    rows = arithmetic_rows(JUDGED + UNSURE, seed=5, max_operand=3)
    for row in rows[JUDGED:]:
        row["uid"] = "unsure-" + row["uid"]
        row["reward_model"]["ground_truth"] = UNJUDGEABLE
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(rows)

    # Phase 1: the policy replica, its sync controller, the judge replica and the agent loop,
    # as the local launcher starts them (the judge's pool from `reward.judge`).
    run = tmp_path / "run"
    with LocalPipeline(
        cfg, run, model_dir=str(tiny_model), replicas=1, stages=("agent-loop",)
    ) as pipe:
        names = [p.name for p in pipe.processes]
        assert names == ["replica-0", "sync-0", "judge-0", "agent-loop"]
        policy, judge = pipe.replica_urls[0], pipe.judge_urls[0]
        for url in (policy, judge):
            wait_for(f"{url} healthy", lambda url=url: _healthy(url), 180, pipe)
        assert get_json(judge + "/info")["role"] == "judge"
        assert get_json(policy + "/health")["role"] == "policy"

        def finals() -> int:
            records = read_all(kafka_config, topics_config.name("turns"), timeout_s=1)
            return sum(decode(r.value).final for r in records) >= TRAJECTORIES

        wait_for("every trajectory's final turn", finals, 240, pipe)
        # Registered, healthy, and never asked: the agent loop routes to policy replicas only.
        assert completions(judge) == 0
        assert completions(policy) >= TRAJECTORIES

        # A new policy version reaches the policy replica (its sync controller), not the judge.
        checkpoint = tmp_path / "ckpt-1"
        shutil.copytree(tiny_model, checkpoint)
        producer = make_producer(kafka_config)
        try:
            event = PolicyVersion(version=1, path=str(checkpoint))
            producer.send(topics_config.name("policy"), key="policy", value=encode(event))
            producer.flush(timeout=30)
        finally:
            producer.close()
        wait_for("the policy at version 1", lambda: get_json(policy + "/health")["version"] == 1,
                 120, pipe)  # fmt: skip
        sync = run_cli("--config", str(run / "config.yaml"), "replica", "sync", "--replica", judge,
                       timeout=120)  # fmt: skip
        assert sync.returncode == 1, sync.stderr
        assert sync.stderr.strip().splitlines() == [
            f"rollout: error: replica {judge} is a judge replica: it follows no policy"
        ], sync.stderr
        body = json.dumps({"path": str(checkpoint), "version": 1}).encode()
        request = urllib.request.Request(judge + "/update_weights", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 409
        assert get_json(judge + "/health")["version"] == 0

        # Phase 2: the reward stage judges every trajectory.
        metrics_port = free_port()
        argv = [*ROLLOUT, "--config", str(run / "config.yaml"), "worker", "reward",
                "--metrics-port", str(metrics_port)]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        reward = spawn_logged(argv, run / "logs" / "reward.log", env=env, cwd=REPO)
        try:

            def scored() -> list:
                records = read_all(kafka_config, topics_config.name("scored"), timeout_s=1)
                if reward.poll() is not None:
                    pytest.fail((run / "logs" / "reward.log").read_text()[-3000:])
                return records if len(records) >= TRAJECTORIES else []

            records = wait_for("every trajectory scored", scored, 240, pipe)
            counts = verdict_counts(metrics_port)
            status = run_cli("--config", str(run / "config.yaml"), "status", "--json",
                             "--interval", "0.1", timeout=120)  # fmt: skip
        finally:
            reward.terminate()
            reward.wait(timeout=30)
        assert completions(judge) == TRAJECTORIES  # one request a trajectory, nothing more
        assert get_json(judge + "/health")["version"] == 0

    failed: dict[str, str] = {}
    verdicts = []
    unsure = set()
    for record in records:
        scored = decode(record.value)
        extra = scored.reward_extra
        if scored.uid.startswith("unsure-"):
            unsure.add(scored.trajectory_id)
        if extra.get("reward_failed"):
            failed[scored.trajectory_id] = extra["reward_error_cause"]
            assert scored.reward_score == FAILURE_SCORE
            assert dict(record.headers)[REWARD_FAILURE] == b"unparseable_verdict"
        else:
            assert extra["scorer"] == "judge" and extra["judge_replicas"] == ["judge-0"]
            assert scored.reward_score in (0.0, 1.0) and "Verdict:" in extra["verdict"]
            verdicts.append(scored.reward_score)
    # The prompts it was taught to refuse all got the failure score, tagged; the judge answered
    # the others in the verdict format (an untrained policy's text may still puzzle it: those
    # are failure-scored and counted alike).
    assert set(failed.values()) == {"unparseable_verdict"} and unsure <= set(failed)
    assert len(unsure) == UNSURE * N and len(verdicts) >= JUDGED * N // 2
    stats = json.loads((tmp_path / "reward-stats.json").read_text())
    assert stats["unparseable_verdicts"] == stats["failure_scored"] == len(failed)
    assert counts == {"parsed": len(verdicts), "unparseable": len(failed)}
    assert status.returncode == 0, status.stderr
    seen = json.loads(status.stdout)
    assert seen["reward_failures"] == {"unparseable_verdict": len(failed)}
    assert {r["replica_id"]: r["role"] for r in seen["replicas"]} == {
        "judge-0": "judge",
        "replica-0": "policy",
    }
    print(
        f"judge: {len(verdicts)} verdicts ({sum(verdicts):.0f} correct), "
        f"{len(failed)} unparseable of which {len(unsure)} refusals taught"
    )


def _healthy(url: str) -> bool:
    try:
        return get_json(url + "/health").get("status") == "ok"
    except (OSError, ValueError):
        return False


STEPS = 2


def test_the_local_launcher_runs_the_judge_pool_from_the_config_beside_a_training_run(
    kafka_config, kafka_bootstrap, topics_config, tiny_model, judge_model, tmp_path
) -> None:
    from pipeline.harness.local_run import merge
    from tests.integration.test_pipeline_e2e import BATCH, pipeline_config

    base = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    settings = {"trainer": {"max_steps": STEPS}, "reward": {"judge": judge_settings(judge_model)}}
    cfg = load_config(None, merge(base.redacted(), settings))
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(24, seed=11, max_operand=3))

    with LocalPipeline(cfg, tmp_path / "run", model_dir=str(tiny_model), replicas=1) as pipe:
        names = [p.name for p in pipe.processes]
        assert names == ["replica-0", "sync-0", "judge-0", "agent-loop", "reward", "replay",
                         "train"]  # fmt: skip
        train = pipe.process("train")
        wait_for("the trainer to finish", lambda: train.proc.poll() is not None, 480, None)
        assert train.proc.returncode == 0, train.tail()
        policy, judge = pipe.replica_urls[0], pipe.judge_urls[0]
        wait_for(f"the policy at version {STEPS}",
                 lambda: get_json(policy + "/health")["version"] == STEPS, 60)  # fmt: skip
        assert get_json(judge + "/health")["version"] == 0  # the judge took no weights
        records = read_all(kafka_config, topics_config.name("scored"), timeout_s=2)
        judged = completions(judge)

    assert len(records) >= STEPS * BATCH * 2  # what the trainer's steps consumed, at least
    for record in records:
        extra = decode(record.value).reward_extra
        assert (
            extra.get("scorer") == "judge" or extra["reward_error_cause"] == "unparseable_verdict"
        )
    assert judged >= len(records)  # every one of them took the judge a request
    print(f"local run: {len(records)} trajectories judged, judge completions {judged:.0f}")
