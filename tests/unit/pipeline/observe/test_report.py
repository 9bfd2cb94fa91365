"""The demo's report writer, driven by synthetic trainer step records (no broker, no torch)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pipeline.observe.report import COLUMNS, step_rows, write_report


def _steps(n: int) -> list[dict]:
    return [
        {
            "event": "step",
            "step": i + 1,
            "time": 1000.0 + 2.0 * (i + 1),
            "reward_mean": 0.1 + 0.5 * i / max(n - 1, 1),
            "staleness_hist": {"0": 6, "1": 2} if i % 2 else {"0": 8},
            "groups": 8,
            "samples": 64,
            "tokens": 300.0,
            "loss": 0.01,
            "entropy": 0.5,
            "is_weight_mean": 1.0,
            "grad_norm": 0.3,
            "step_time_s": 0.2,
        }
        for i in range(n)
    ]


def test_writes_every_file_with_the_right_keys(tmp_path: Path) -> None:
    info = {
        "bootstrap": "127.0.0.1:9092",
        "topics": {"turns": "demo.turns"},
        "replay": ["rollout --bootstrap 127.0.0.1:9092 consume --topic turns"],
    }
    summary = write_report(tmp_path, _steps(20), wall_s=123.4, info=info, started_at=1000.0)

    for name in ("report.png", "metrics.csv", "metrics.json", "summary.json", "summary.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    for key in ("reward_first_10pct", "reward_last_10pct", "steps", "wall_s", "topics", "replay"):
        assert key in saved, key
    assert saved["steps"] == 20 and saved["wall_s"] == pytest.approx(123.4)
    # first/last 10% of 20 steps are 2 steps each
    rewards = [r["reward_mean"] for r in _steps(20)]
    assert saved["reward_first_10pct"] == pytest.approx(sum(rewards[:2]) / 2)
    assert saved["reward_last_10pct"] == pytest.approx(sum(rewards[-2:]) / 2)

    with (tmp_path / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 20 and tuple(rows[0]) == COLUMNS
    assert float(rows[1]["staleness_mean"]) == pytest.approx(0.25)
    assert json.loads((tmp_path / "metrics.json").read_text())[0]["samples_per_s"] == 32.0
    text = (tmp_path / "summary.txt").read_text()
    assert "demo.turns" in text and "consume --topic turns" in text


def test_windows_round_up_and_rows_sort_by_step(tmp_path: Path) -> None:
    steps = list(reversed(_steps(3)))
    assert [r["step"] for r in step_rows(steps)] == [1, 2, 3]
    summary = write_report(tmp_path, steps, wall_s=1.0)
    assert summary["window_steps"] == 1
    assert summary["reward_first_10pct"] == pytest.approx(0.1)
    assert summary["reward_last_10pct"] == pytest.approx(0.6)
