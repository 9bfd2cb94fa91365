"""The soak's pure parts: backlog controller, percentiles, stage rates, memory check, tables."""

from __future__ import annotations

import math

import pytest

from pipeline.harness.load.figures import (
    BacklogController,
    MemoryRow,
    latency_summary,
    memory_rows,
    percentile,
    render,
    stage_rates,
    stale_share,
)

MB = 1024 * 1024


def test_backlog_controller_tops_up_to_target_and_never_beyond() -> None:
    ctl = BacklogController(target=10, max_burst=4)
    assert ctl.to_send(produced=0, consumed=0) == 4  # a burst at most
    assert ctl.to_send(produced=8, consumed=0) == 2
    assert ctl.to_send(produced=10, consumed=0) == 0
    assert ctl.to_send(produced=10, consumed=7) == 4  # 3 waiting: 7 short, one burst
    assert ctl.to_send(produced=12, consumed=12) == 4
    # Counters read before the producer's own count (consumer ahead): never negative.
    assert ctl.to_send(produced=5, consumed=9) == 4
    assert BacklogController(target=3).to_send(produced=50, consumed=48) == 1


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_latency_summary() -> None:
    summary = latency_summary([1.0, 2.0, 3.0, 4.0, 100.0])
    assert summary["count"] == 5
    assert summary["p50_s"] == 3.0
    assert summary["p99_s"] == pytest.approx(96.16)
    assert summary["max_s"] == 100.0
    assert latency_summary([])["count"] == 0


def test_stage_rates_from_two_snapshots() -> None:
    before = {("reward", "turns", "consumed"): 100.0, ("reward", "scored", "produced"): 50.0}
    after = {
        ("reward", "turns", "consumed"): 400.0,
        ("reward", "scored", "produced"): 350.0,
        ("train", "replay", "consumed"): 30.0,  # appeared after the first snapshot
    }
    rates = stage_rates(before, after, seconds=60.0)
    assert rates == {
        "reward": {"produced scored": 5.0, "consumed turns": 5.0},
        "train": {"consumed replay": 0.5},
    }
    assert stage_rates(before, after, 0.0)["reward"]["consumed turns"] == 0.0


def test_memory_growth_check() -> None:
    samples = {
        "start": {"reward": 80 * MB, "replay": 90 * MB, "broker": 300 * MB},
        "baseline": {"reward": 100 * MB, "replay": 100 * MB, "broker": 300 * MB},
        "end": {"reward": 119 * MB, "replay": 120 * MB, "broker": 900 * MB},
        "peak": {"reward": 121 * MB, "replay": 120 * MB, "broker": 900 * MB},
    }
    rows = {r.process: r for r in memory_rows(samples, checked=["reward", "replay"])}
    assert rows["reward"].growth_pct == pytest.approx(19.0)
    assert rows["reward"].ok(20.0)
    assert rows["replay"].growth_pct == pytest.approx(20.0)
    assert not rows["replay"].ok(20.0)  # the limit itself fails: growth must stay under it
    assert rows["broker"].growth_pct == pytest.approx(200.0)
    assert rows["broker"].ok(20.0)  # reported, not checked
    assert rows["reward"].start_mb == 80.0 and rows["reward"].peak_mb == 121.0
    # A process that was gone at the baseline (RSS 0) can never pass.
    gone = MemoryRow("x", 0.0, 0.0, 10.0, 10.0, checked=True)
    assert gone.growth_pct == math.inf and not gone.ok(20.0)
    # Shrinking is fine.
    assert MemoryRow("y", 1.0, 100.0, 50.0, 100.0, checked=True).ok(20.0)


def test_render_shows_every_table_and_the_verdict() -> None:
    rows = memory_rows(
        {
            "start": {"train": 5 * MB},
            "baseline": {"train": 10 * MB},
            "end": {"train": 15 * MB},
            "peak": {"train": 15 * MB},
        },
        checked=["train"],
    )
    report = {
        "minutes": 3,
        "baseline_minute": 2,
        "ready_s": 40.0,
        "backlog_target": 8,
        "prompts_per_s": 2.0,
        "trajectories_per_s": 8.0,
        "throughput": {"reward": {"consumed turns": 8.0, "produced scored": 8.0}},
        "latency": {"count": 10, "p50_s": 1.5, "p99_s": 3.0, "max_s": 3.1, "unscored": 0},
        "lag": [
            {"t_s": 0.0, "groups": {"agent-loop": {"prompts": 24}}},
            {"t_s": 15.0, "groups": {"agent-loop": {"prompts": 20}, "trainer": {"replay": 3}}},
        ],
        "memory_limit_pct": 20.0,
        "stale_share": 0.0,
        "max_staleness": 8,
        "staleness_max": 3,
        "memory": [{**r.__dict__, "growth_pct": r.growth_pct, "ok": r.ok(20.0)} for r in rows],
        "problems": ["train grew 50.0% (limit 20.0%)"],
        "ok": False,
    }
    text = render(report)
    assert "consumed turns" in text and "p99 3.0 s" in text
    assert "agent-loop prompts" in text and "trainer replay" in text
    assert "+50.0" in text and "FAIL" in text
    assert "0.0% of the trained groups past the bound of 8 (largest 3)" in text
    assert text.splitlines()[-1] == "NOT OK"


def test_stale_share_counts_the_trained_groups_past_the_bound() -> None:
    steps = [{"staleness_hist": {"0": 3, "2": 1}}, {"staleness_hist": {"9": 1, "1": 5}}, {}]
    assert stale_share(steps, 8) == {
        "groups_trained": 10,
        "stale_share": 0.1,
        "staleness_max": 9,
        "max_staleness": 8,
    }
    assert stale_share([], 8)["stale_share"] == 0.0
