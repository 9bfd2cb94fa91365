"""The chaos suite's short case, in `make test`: one of two agent-loop workers is killed -9
mid-stream and restarted; every sample is still trained exactly once (`make chaos` runs the
long case: every stage killed, a worker stopped, the broker restarted)."""

from __future__ import annotations

import pytest

from pipeline.harness.chaos.run import ChaosOptions, run_chaos

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_killing_a_worker_mid_stream_loses_nothing_and_trains_nothing_twice(
    kafka_bootstrap, tmp_path
) -> None:
    report = run_chaos(
        ChaosOptions(
            samples=64,
            n=4,
            agent_loop_workers=2,
            replicas=1,
            faults=("kill:agent-loop-0",),
            bootstrap=kafka_bootstrap,
            run_dir=str(tmp_path),
            timeout_s=400,
            progress=False,
            max_tokens=16,
            # Fire while the replicas are generating: the samples come out in one step.
            trigger="generating",
        )
    )
    print(report["table"])
    assert [f["fault"] for f in report["faults_fired"]] == ["kill:agent-loop-0"]
    assert report["faults_fired"][0]["share"] < 1.0, "the kill must land while work is in flight"
    accounting = report["accounting"]
    assert accounting["lost"] == 0 and accounting["duplicated"] == 0, report["table"]
    assert accounting["trained"] + accounting["stale"] == 64
    assert report["table"].endswith("lost=0 duplicated=0")
    assert report["ok"]


def test_faults_left_late_grow_the_run_and_every_sample_still_counts(
    kafka_bootstrap, tmp_path
) -> None:
    # topup_share 0: the fault counts as late at once, so the run grows before it fires
    report = run_chaos(
        ChaosOptions(
            samples=32,
            n=4,
            agent_loop_workers=1,
            replicas=1,
            faults=("kill:replay",),
            bootstrap=kafka_bootstrap,
            run_dir=str(tmp_path),
            timeout_s=400,
            progress=False,
            max_tokens=16,
            topup_share=0.0,
            max_topups=1,
        )
    )
    print(report["table"])
    assert report["samples_added"] == 16 and report["samples"] == 48
    assert [f["fault"] for f in report["faults_fired"]] == ["kill:replay"]
    accounting = report["accounting"]
    assert accounting["lost"] == 0 and accounting["duplicated"] == 0, report["table"]
    assert accounting["trained"] + accounting["stale"] == 48
    assert report["ok"]
