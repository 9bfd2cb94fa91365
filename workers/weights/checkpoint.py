"""Atomic trainer checkpoints: weights, tokenizer, optimizer and the consumer offsets, together.

Layout under the checkpoint root:

    step-N/                     one checkpoint, N = policy version = trainer global step
      model.safetensors         weights (names of the model's state_dict; tied lm_head omitted)
      config.json, generation_config.json, tokenizer files (copied from the source model)
      optimizer/state.safetensors   AdamW moments and steps, keyed "<param index>.<name>"
      optimizer/param_groups.json   AdamW hyper-parameters
      (in a subfolder: replicas load every top-level *.safetensors as weights)
      trainer_state.json        `TrainerState`: version, counters, consumer positions, dedup keys
    latest                      "step-N\n": the newest complete checkpoint

Invariants:
- A checkpoint is written into `step-N.tmp/`, every file fsynced, then renamed to `step-N/`
  and the root fsynced; only then is `latest` replaced (write `latest.tmp`, fsync, rename).
  A crash at any point leaves `latest` naming a complete checkpoint (or none).
- The weights and the positions in one checkpoint belong together: the weights are exactly
  the result of training every record before the positions and none after.
- `step-N/` is published to replicas only after `latest` names it, so a `step-N/` that
  `latest` does not name was never published and may be replaced.
- Pruning keeps the newest `keep` checkpoints and never the one `latest` names.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.weights.exceptions import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Checkpoint",
    "TrainerState",
    "load_latest",
    "load_optimizer",
    "prune",
    "save_checkpoint",
    "update_state",
]

log = logging.getLogger("rollout.trainer.checkpoint")

STATE_FILE = "trainer_state.json"
LATEST = "latest"
OPTIMIZER_DIR = "optimizer"
_NOT_TOKENIZER = {"config.json", "generation_config.json", STATE_FILE}


@dataclass
class TrainerState:
    """What a restarted trainer needs besides the weights (JSON in `trainer_state.json`)."""

    version: int = 0
    groups_consumed: int = 0  # trained + stale + duplicates + dead-lettered
    samples_consumed: int = 0
    groups_trained: int = 0
    samples_trained: int = 0
    groups_stale: int = 0
    groups_duplicate: int = 0
    groups_dead_lettered: int = 0  # could not train (an image gone from the media store)
    positions: dict[str, int] = field(default_factory=dict)
    recent_groups: list[str] = field(default_factory=list)  # dedup keys, oldest first
    source_model: str = ""
    created_at: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: TrainerState


def _step_dir(root: Path, version: int) -> Path:
    return root / f"step-{version}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for item in src.iterdir():
        if (
            item.is_file()
            and item.name not in _NOT_TOKENIZER
            and not item.name.endswith(".safetensors")
            and not item.name.endswith(".safetensors.index.json")
        ):
            shutil.copy2(item, dst / item.name)


def _save_optimizer(optimizer: torch.optim.Optimizer, dst: Path) -> None:
    from safetensors.torch import save_file

    sd = optimizer.state_dict()
    tensors = {
        f"{index}.{name}": value.detach().contiguous().cpu()
        for index, slots in sd["state"].items()
        for name, value in slots.items()
    }
    folder = dst / OPTIMIZER_DIR
    folder.mkdir()
    save_file(tensors, str(folder / "state.safetensors"))
    (folder / "param_groups.json").write_text(json.dumps(sd["param_groups"]))


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> bool:
    """Restore AdamW state saved with a checkpoint; False if the checkpoint has none."""
    from safetensors.torch import load_file

    folder = path / OPTIMIZER_DIR
    tensors_file, groups_file = folder / "state.safetensors", folder / "param_groups.json"
    if not tensors_file.is_file() or not groups_file.is_file():
        return False
    state: dict[int, dict[str, Any]] = {}
    for key, value in load_file(str(tensors_file)).items():
        index, _, name = key.partition(".")
        state.setdefault(int(index), {})[name] = value
    groups = json.loads(groups_file.read_text())
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return True


def save_checkpoint(
    root: str | Path,
    state: TrainerState,
    model: Any,
    *,
    tokenizer_from: str | Path,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write `step-<state.version>/` atomically, then point `latest` at it; returns the path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = _step_dir(root, state.version)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(str(tmp), safe_serialization=True)
    _copy_tokenizer(Path(tokenizer_from), tmp)
    if optimizer is not None:
        _save_optimizer(optimizer, tmp)
    state.created_at = time.time()
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), sort_keys=True))
    for item in sorted(tmp.rglob("*"), reverse=True):  # files before their folders
        if item.is_dir():
            _fsync_dir(item)
        else:
            _fsync_file(item)
    _fsync_dir(tmp)
    if final.exists():  # written by a run that died before `latest` named it: never published
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(final.name + "\n")
    _fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    log.info("checkpoint version=%d written to %s", state.version, final)
    return final


def update_state(path: str | Path, state: TrainerState) -> None:
    """Rewrite the state of the checkpoint at `path` in place (atomic file replace).

    Only for progress that changes no weight: the same version, with positions moved past
    records that were dropped (stale, duplicate), never past one that was trained.
    """
    path = Path(path)
    old = json.loads((path / STATE_FILE).read_text())
    if int(old["version"]) != state.version:
        raise CheckpointError(f"{path} holds version {old['version']}, not {state.version}")
    tmp = path / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(state), sort_keys=True))
    _fsync_file(tmp)
    os.replace(tmp, path / STATE_FILE)
    _fsync_dir(path)


def load_latest(root: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` names (None when there is none)."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{pointer} names {path}, which has no {STATE_FILE}")
    state = TrainerState.from_json(json.loads(state_file.read_text()))
    return Checkpoint(path=path, state=state)


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names)."""
    root = Path(root)
    pointer = root / LATEST
    current = pointer.read_text().strip() if pointer.is_file() else None
    steps = []
    for item in root.iterdir():
        name = item.name
        if item.is_dir() and name.startswith("step-") and name[5:].isdigit():
            steps.append((int(name[5:]), item))
    steps.sort()
    removed = []
    for _, path in steps[: max(0, len(steps) - keep)]:
        if path.name != current:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
