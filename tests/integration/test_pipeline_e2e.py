"""The whole loop on the real broker, every stage its own process, CPU only:
prompts → agent-loop worker → reward worker → replay stage → trainer → weights → replicas,
the weights by checkpoint (`disk`) and over the trainer's process group (`broadcast`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.clients import PromptProducer
from pipeline.config import load_config
from pipeline.data.arithmetic import arithmetic_rows
from pipeline.launch.local import LocalPipeline
from tests.conftest import run_cli
from tests.http import http

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STEPS = 3
BATCH = 2  # groups per trainer step


def pipeline_config(
    kafka_bootstrap: str,
    topics_prefix: str,
    model: Path,
    run_dir: Path,
    max_staleness: int,
    weight_transfer: str = "disk",
):
    return load_config(
        None,
        {
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "topics": {"prefix": topics_prefix},
            "agent_loop": {
                "group_id": f"{topics_prefix}agent-loop",
                "model": str(model),
                "n": 2,
                "max_samples_in_flight": 8,
                "commit_interval_s": 0.5,
                "sampling": {"max_tokens": 8, "temperature": 1.0},
                # broadcast: replicas serve once the trainer (which starts last) sent weights
                "llm": {"health_interval_s": 1.0, "no_replica_wait_s": 180.0},
            },
            "reward": {
                "group_id": f"{topics_prefix}reward",
                "tokenizer": str(model),
                "batch_within_s": 0.1,
                "commit_interval_s": 0.5,
            },
            "replay": {
                "group_id": f"{topics_prefix}replay",
                "n": 2,
                "batch_within_s": 0.1,
                "commit_interval_s": 0.5,
            },
            "trainer": {
                "model_dir": str(model),
                "checkpoint_dir": str(run_dir / "ckpt"),
                "group_id": f"{topics_prefix}trainer",
                "train_batch_size": BATCH,
                "sync_every": 1,
                "max_steps": STEPS,
                "max_staleness": max_staleness,  # the gate's and the replay stage's too
                "torch_threads": 1,
                "lr": 1e-3,
            },
            "weights": {"mode": weight_transfer},
        },
    )


def served_version(url: str) -> int | None:
    """The version a replica serves, also while it answers 503 awaiting the trainer's weights:
    one the trainer stopped before serving takes the last checkpoint the checkpoint way, a
    moment after the trainer exits. None while it does not answer."""
    _, body = http(url + "/health", timeout=5)
    return body.get("version") if isinstance(body, dict) else None


#: Every staleness bound over the disk; broadcast once in `make test` (staleness 1), the other
#: two in `make test-long` (the transfer is the same at every bound).
CASES = [
    *(pytest.param(s, "disk", id=f"{s}-disk") for s in (0, 1, 2)),
    pytest.param(1, "broadcast", id="1-broadcast"),
    *(pytest.param(s, "broadcast", id=f"{s}-broadcast", marks=pytest.mark.long) for s in (0, 2)),
]


@pytest.mark.parametrize(("max_staleness", "weight_transfer"), CASES)
def test_the_loop_trains_and_weights_flow_back(
    kafka_config,
    kafka_bootstrap,
    topics_config,
    tiny_model,
    tmp_path,
    max_staleness,
    weight_transfer,
) -> None:
    cfg = pipeline_config(
        kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, max_staleness, weight_transfer
    )
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(
            arithmetic_rows(24, seed=max_staleness), uid_prefix=f"e2e{max_staleness}"
        )

    steps: list[dict] = []
    metrics = tmp_path / "ckpt" / "metrics.jsonl"
    with LocalPipeline(cfg, tmp_path / "run", model_dir=str(tiny_model), replicas=2) as pipe:
        deadline = time.monotonic() + 400
        status = None
        while time.monotonic() < deadline:
            if pipe.process("train").proc.poll() is not None:
                break
            pipe.check()
            # `status` once version 1 is on `rl.policy`: the trainer logs a step before it
            # checkpoints and publishes it.
            if status is None and _published(metrics) >= 1:
                status = run_status(kafka_bootstrap, topics_config.prefix)
            time.sleep(1.0)
        if status is None:  # the trainer finished within a second of its first version
            status = run_status(kafka_bootstrap, topics_config.prefix)
        train = pipe.process("train")
        assert train.proc.poll() == 0, train.tail()
        steps = [
            r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"
        ]
        # The replicas loaded every published version while generation went on.
        for _ in range(30):
            versions = [served_version(url) for url in pipe.replica_urls]
            if all(v is not None and v >= STEPS for v in versions):
                break
            time.sleep(1.0)
        assert versions == [STEPS] * 2, versions
        # Every replica is registered once it serves (the status above, taken at version 1,
        # may be before a slow one registered: a replica awaiting its first weights).
        final = run_status(kafka_bootstrap, topics_config.prefix)
    # A trainer that stops ends its store under the controllers' waits: each says so in one
    # line, and torch's C++ stack of the same (some 25 lines) is not printed.
    for log in sorted((tmp_path / "run" / "logs").glob("sync-*.log")):
        assert "frame #" not in log.read_text(errors="replace"), log

    # `rollout status` against the running pipeline: lag, the live version, the replicas.
    assert status is not None and status.returncode == 0, status and status.stderr
    seen = json.loads(status.stdout)
    lags = {(g, t): row["lag"] for g, topics in seen["groups"].items() for t, row in topics.items()}
    assert any(lag > 0 for lag in lags.values()), lags  # prompts wait behind the admission gate
    assert (f"{topics_config.prefix}agent-loop", topics_config.name("prompts")) in lags
    assert seen["policy_version"] >= 1
    assert {r["replica_id"] for r in seen["replicas"]} <= {"replica-0", "replica-1"}, seen
    assert final.returncode == 0, final.stderr
    registered = sorted(r["replica_id"] for r in json.loads(final.stdout)["replicas"])
    assert registered == ["replica-0", "replica-1"], registered
    assert all(r["healthy"] and isinstance(r["version"], int) for r in seen["replicas"])
    assert seen["dlq_count"] == 0

    assert [s["step"] for s in steps][-STEPS:] == list(range(1, STEPS + 1))
    for step in steps:
        seen = [int(k) for k in step["staleness_hist"]]
        assert max(seen) <= max_staleness, step["staleness_hist"]
        assert step["groups"] == BATCH and step["samples"] == 2 * BATCH
    if max_staleness == 0:
        for step in steps:
            assert step["is_weight_mean"] == pytest.approx(1.0, abs=2e-3), step
            assert step["is_weight_min"] > 0.98 and step["is_weight_max"] < 1.02


def run_status(bootstrap: str, prefix: str):
    return run_cli(
        "--bootstrap",
        bootstrap,
        "--set",
        f"topics.prefix={prefix}",
        "status",
        "--json",
        "--interval",
        "0.5",
    )


def _published(metrics: Path) -> int:
    """The newest version the trainer has checkpointed and published (0 before any); a line
    the trainer is still writing is skipped."""
    if not metrics.exists():
        return 0
    newest = 0
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("event") == "checkpoint":
            newest = max(newest, row["version"])
    return newest
