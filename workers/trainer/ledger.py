"""Bookkeeping of what the trainer has consumed: the batch being collected, and dedup keys.

Every record the trainer takes from the replay topic becomes an `Entry` of the `Pending`
batch: `train` (goes into the next step), `stale` (sent to the stale topic), `duplicate`
(already trained; skipped) or `dead_letter` (cannot train, e.g. its image is gone from the
media store; sent to the dead-letter topic). Nothing is applied to the `TrainerState` until
it is settled:

- a completed step settles every entry, with the consumer's positions after them;
- `Pending.settle_drops` settles only dropped entries that lie *before* the first pending
  `train` entry of their partition, and cuts each such partition's position at that train
  entry, so the state never covers a record whose training has not happened yet. This lets
  a trainer that stops (or idles) mid-batch persist its drops without covering the
  half-collected batch, which is abandoned and re-consumed after a restart.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.events import TrainingGroup
from workers.trainer.consumer import Item, position_key
from workers.weights.checkpoint import TrainerState

__all__ = ["DedupWindow", "Entry", "Pending", "apply_entries", "dedup_key"]

Kind = Literal["train", "stale", "duplicate", "dead_letter"]


def dedup_key(group: TrainingGroup) -> str:
    """Identity of one emission of a group: its uid and the attempts of its samples."""
    attempts = sorted(f"{s.trajectory_id}@{s.attempt_id}" for s in group.samples)
    digest = hashlib.sha1("\n".join(attempts).encode(), usedforsecurity=False).hexdigest()[:16]
    return f"{group.uid}#{digest}"


@dataclass(frozen=True)
class Entry:
    item: Item
    kind: Kind
    key: str

    @property
    def partition(self) -> str:
        return position_key(self.item.topic, self.item.partition)

    @property
    def samples(self) -> int:
        return len(self.item.event.samples)


@dataclass
class Pending:
    """The batch being collected (see the module docstring)."""

    entries: list[Entry] = field(default_factory=list)
    futures: list[Any] = field(default_factory=list)  # stale sends not yet acknowledged

    def add(self, item: Item, kind: Kind, key: str) -> None:
        self.entries.append(Entry(item, kind, key))

    @property
    def train(self) -> list[Item]:
        return [e.item for e in self.entries if e.kind == "train"]

    @property
    def keys(self) -> set[str]:
        return {e.key for e in self.entries}

    def has_drops(self) -> bool:
        return any(e.kind != "train" for e in self.entries)

    def drop_count(self) -> int:
        return sum(e.kind != "train" for e in self.entries)

    def settle_drops(self, positions: dict[str, int]) -> tuple[list[Entry], dict[str, int]]:
        """Remove and return the drops safe to settle now, and the positions that cover them."""
        first_train: dict[str, int] = {}
        for e in self.entries:
            if e.kind == "train":
                first_train[e.partition] = min(
                    first_train.get(e.partition, e.item.offset), e.item.offset
                )
        settled = [
            e
            for e in self.entries
            if e.kind != "train" and e.item.offset < first_train.get(e.partition, 1 << 62)
        ]
        ids = {id(e) for e in settled}
        self.entries = [e for e in self.entries if id(e) not in ids]
        return settled, {**positions, **first_train}


def apply_entries(state: TrainerState, entries: Iterable[Entry], positions: dict[str, int]) -> None:
    """Count settled entries into the state and move its positions."""
    for e in entries:
        state.groups_consumed += 1
        state.samples_consumed += e.samples
        if e.kind == "train":
            state.groups_trained += 1
            state.samples_trained += e.samples
        elif e.kind == "stale":
            state.groups_stale += 1
        elif e.kind == "dead_letter":
            state.groups_dead_lettered += 1
        else:
            state.groups_duplicate += 1
    state.positions = dict(positions)


class DedupWindow:
    """The keys of the most recent `size` settled groups (0: no de-duplication)."""

    def __init__(self, keys: Iterable[str], size: int) -> None:
        self.size = size
        self._order: deque[str] = deque(maxlen=size or None)
        self._set: set[str] = set()
        self.add(keys)

    def __contains__(self, key: str) -> bool:
        return key in self._set

    def add(self, keys: Iterable[str]) -> None:
        if not self.size:
            return
        for key in keys:
            if key in self._set:
                continue
            if len(self._order) == self.size:
                self._set.discard(self._order[0])
            self._order.append(key)
            self._set.add(key)

    def to_list(self) -> list[str]:
        return list(self._order)
