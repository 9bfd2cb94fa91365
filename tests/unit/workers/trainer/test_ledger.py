"""Trainer bookkeeping without a broker: settling drops, dedup, the step log, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from workers.trainer.config import TrainerConfig
from workers.trainer.consumer import Item
from workers.trainer.exceptions import CheckpointError
from workers.trainer.ledger import DedupWindow, Pending, apply_entries
from workers.trainer.steplog import effective_steps, effective_trajectory_ids
from workers.weights.checkpoint import (
    TrainerState,
    load_latest,
    prune,
    save_checkpoint,
    update_state,
)


def _item(partition: int, offset: int, samples: int = 2) -> Item:
    event = SimpleNamespace(samples=[None] * samples)
    return Item(event, "rl.replay", partition, offset, None, b"", [])


def test_settle_drops_never_covers_a_pending_train_entry() -> None:
    pending = Pending()
    pending.add(_item(0, 10), "stale", "a")
    pending.add(_item(0, 11), "train", "b")
    pending.add(_item(0, 12), "stale", "c")  # after a pending train entry: must wait
    pending.add(_item(1, 5), "duplicate", "d")
    settled, positions = pending.settle_drops({"rl.replay:0": 13, "rl.replay:1": 6})
    assert [e.key for e in settled] == ["a", "d"]
    assert positions == {"rl.replay:0": 11, "rl.replay:1": 6}
    assert [e.key for e in pending.entries] == ["b", "c"]
    state = TrainerState()
    apply_entries(state, settled, positions)
    assert (state.groups_consumed, state.groups_stale, state.groups_duplicate) == (2, 1, 1)
    assert state.groups_trained == 0 and state.samples_consumed == 4
    apply_entries(state, pending.entries, {"rl.replay:0": 13, "rl.replay:1": 6})
    assert state.groups_trained == 1 and state.groups_consumed == 4


def test_a_dead_lettered_group_is_consumed_and_counted_apart() -> None:
    pending = Pending()
    pending.add(_item(0, 3), "dead_letter", "gone")
    pending.add(_item(0, 4), "train", "kept")
    assert pending.drop_count() == 1 and [i.offset for i in pending.train] == [4]
    state = TrainerState()
    apply_entries(state, pending.entries, {"rl.replay:0": 5})
    assert (state.groups_consumed, state.groups_trained, state.groups_dead_lettered) == (2, 1, 1)
    assert state.groups_stale == 0 and state.groups_duplicate == 0


def test_dedup_window_forgets_the_oldest() -> None:
    window = DedupWindow(["a", "b"], size=3)
    window.add(["c", "d"])
    assert "a" not in window and all(k in window for k in "bcd")
    assert window.to_list() == ["b", "c", "d"]
    off = DedupWindow(["a"], size=0)
    assert "a" not in off


def test_effective_steps_discard_what_a_killed_process_lost(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    lines: list[dict[str, Any]] = [
        {"event": "start", "version": 0},
        {"event": "step", "step": 1, "trajectory_ids": ["a"]},
        {"event": "step", "step": 2, "trajectory_ids": ["b"]},
        {"event": "checkpoint", "version": 2},
        {"event": "step", "step": 3, "trajectory_ids": ["c"]},  # lost with the process
        {"event": "start", "version": 2},
        {"event": "step", "step": 3, "trajectory_ids": ["c2"]},
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"torn')
    assert effective_trajectory_ids(log) == ["a", "b", "c2"]
    assert sorted(effective_steps(log, upto=2)) == [1, 2]


class _FakeModel:
    def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
        (Path(path) / "model.safetensors").write_bytes(b"weights")
        (Path(path) / "config.json").write_text("{}")


def test_checkpoints_are_atomic_pruned_and_updatable(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"old")
    root = tmp_path / "ckpt"
    assert load_latest(root) is None
    (root / "step-3.tmp").mkdir(parents=True)  # debris of a crash mid-write
    for version in (1, 2, 3):
        state = TrainerState(version=version, positions={"rl.replay:0": version * 10})
        save_checkpoint(root, state, _FakeModel(), tokenizer_from=source)
    latest = load_latest(root)
    assert latest is not None and latest.path.name == "step-3"
    assert latest.state.positions == {"rl.replay:0": 30}
    assert (latest.path / "tokenizer.json").is_file()
    assert (latest.path / "model.safetensors").read_bytes() == b"weights"
    assert not (root / "step-3.tmp").exists()
    assert [p.name for p in prune(root, keep=2)] == ["step-1"]
    state = latest.state
    state.groups_stale = 7
    state.positions = {"rl.replay:0": 31}
    update_state(latest.path, state)
    reread = load_latest(root)
    assert reread is not None and reread.state.groups_stale == 7
    with pytest.raises(CheckpointError):
        update_state(latest.path, TrainerState(version=9))


def test_config_cross_field_rules() -> None:
    TrainerConfig(max_staleness=1, sync_every=2)
    with pytest.raises(ValidationError):
        TrainerConfig(max_staleness=0, sync_every=2)
    TrainerConfig(max_staleness=0, sync_every=2, stale_policy="keep")
    with pytest.raises(ValidationError):
        TrainerConfig(keep_checkpoints=1)
    assert TrainerConfig(checkpoint_dir="/x/").metrics_path == "/x/metrics.jsonl"


def test_trainer_package_imports_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, workers.trainer, workers.trainer.config, workers.trainer.consumer,"
        " workers.weights.sync, workers.weights.checkpoint, workers.trainer.ledger;"
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
