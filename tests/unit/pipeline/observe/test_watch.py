"""What `rollout up` says before any stage starts: the steps the waiting prompts allow."""

from __future__ import annotations

import logging

from pipeline.observe.watch import DataOutlook
from workers.kafka.stage_stats import StageStats


def test_the_outlook_says_how_many_steps_the_prompts_make() -> None:
    enough = DataOutlook("cc4.prompts", waiting=20, batch=8, version=0, max_steps=2)
    assert enough.steps == 2
    assert enough.lines() == [
        "20 prompts wait on cc4.prompts: at most 2 steps of 8 groups (trainer.train_batch_size)"
    ]
    short = DataOutlook("cc4.prompts", waiting=20, batch=8, version=1, max_steps=10)
    have, need = short.lines()
    assert have.endswith(", from version 1")
    assert need.startswith("--steps 10 needs 52 prompts more: after step 3 the trainer waits")


def test_drops_are_said_with_their_count(caplog) -> None:
    stats = StageStats()
    logger = logging.getLogger("test.stats")
    stats.warn_growth(("after_done",), "%d dropped", logger)
    assert not caplog.records  # nothing dropped: nothing said
    stats.add("after_done", 3)
    stats.add("duplicate_completion", 1)
    with caplog.at_level(logging.WARNING):
        stats.warn_growth(("after_done", "duplicate_completion"), "%d dropped", logger, 0)
        stats.warn_growth(("after_done", "duplicate_completion"), "%d dropped", logger, 0)
        stats.add("after_done")
        stats.warn_growth(("after_done", "duplicate_completion"), "%d dropped", logger, 0)
    assert [r.getMessage() for r in caplog.records] == ["4 dropped", "5 dropped"]


def test_the_view_shows_what_the_stages_dropped_as_done(tmp_path) -> None:
    import json

    from pipeline.config import load_config
    from pipeline.observe.watch import RunWatch

    paths = {s: tmp_path / f"{s}.json" for s in ("reward", "replay")}
    cfg = load_config(None, {s: {"stats_path": str(p)} for s, p in paths.items()})
    watch = RunWatch(cfg, [], title="t", live=False)
    try:
        assert watch.dropped_as_done() == ""  # no stats yet: nothing said
        paths["reward"].write_text(json.dumps({"after_done": 1600, "duplicate_completion": 4}))
        paths["replay"].write_text(json.dumps({"duplicates": 0, "late_samples": 0}))
        assert watch.dropped_as_done() == "reward 1604"
    finally:
        watch.close()


def test_a_run_waiting_for_prompts_is_said_idle_once_per_wait() -> None:
    """`rollout up` with fewer prompts than --steps needs: after the last step the data
    allows, the trainer waits. The wait is said in one line after IDLE_S, not while anything
    still generates or waits at a stage, and said again only after a new step."""
    from pipeline.config import load_config
    from pipeline.observe.progress import Snapshot
    from pipeline.observe.watch import IDLE_S, RunWatch

    cfg = load_config(None, {"topics": {"prefix": "exp1."}, "trainer": {"max_steps": 20}})
    watch = RunWatch(cfg, [], title="t", live=False)
    quiet = {"lag": 0, "in_flight": 0}
    stages = {"agent-loop": dict(quiet), "reward": dict(quiet), "trainer": {"lag": 0}}
    snap = Snapshot(stages=stages, step=8, steps=[{"step": s} for s in range(1, 9)])
    t0 = watch.started
    try:
        assert watch.idle_line(snap, t0 + 1) is None  # step 8 just came
        assert watch.idle_line(snap, t0 + IDLE_S) is None  # not idle long enough yet
        stages["agent-loop"]["in_flight"] = 3  # still generating: no line
        assert watch.idle_line(snap, t0 + IDLE_S + 2) is None
        stages["agent-loop"]["in_flight"], stages["reward"]["lag"] = 0, 5  # records waiting
        assert watch.idle_line(snap, t0 + IDLE_S + 3) is None
        stages["reward"]["lag"] = 0
        line = watch.idle_line(snap, t0 + IDLE_S + 4)
        assert line is not None and line.startswith("rollout: idle after step 8 for ")
        assert "every prompt on exp1.prompts is taken" in line
        assert "rollout --set topics.prefix=exp1. produce" in line
        assert watch.idle_line(snap, t0 + 3 * IDLE_S) is None  # said once per wait
        snap.steps.append({"step": 9})
        snap.step = 9
        assert watch.idle_line(snap, t0 + 3 * IDLE_S) is None  # a new step: a new wait
        assert watch.idle_line(snap, t0 + 4 * IDLE_S + 1) is not None
        snap.steps.extend({"step": s} for s in range(10, 21))
        snap.step = 20
        assert watch.idle_line(snap, t0 + 5 * IDLE_S) is None
        assert watch.idle_line(snap, t0 + 9 * IDLE_S) is None  # at --steps: done, not idle
    finally:
        watch.close()
