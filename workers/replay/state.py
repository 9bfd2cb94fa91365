"""The replay stage's table: one small header per group, one raw value per sample. Pure logic.

The `groups` table (changelogged, partitioned like `rl.scored`) holds two kinds of keys:

    b"g\\0" + uid             → `GroupState` (orjson, magic b"RG1"): the group's header
    b"s\\0" + trajectory_id   → the sample's `ScoredTrajectory` bytes, exactly as consumed

Samples are written once each (never rewritten when the group grows) and deleted by
tombstone when the group is DONE. A header's lifecycle:

    PENDING ──n distinct samples, or timeout──► EMITTING (marker: where the output goes)
    EMITTING ──output acknowledged──► DONE (samples deleted)
    EMITTING ──found after a crash on the output partition──► DONE
    EMITTING ──not found after a crash──► finished again (re-judged) ──► EMITTING ...

Invariants: a header lists in `indices` only samples whose bytes were written to the
changelog before it (same changelog partition, one idempotent producer, so order holds);
a DONE header is kept (small) so later duplicates of its uid are recognised, and so is the
prompt's content digest: a sample of another prompt under the same uid is told apart from a
redelivery (`duplicate_uid`) whatever the group's status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

__all__ = ["GroupState", "Status", "group_key", "is_group_key", "sample_key"]

Status = Literal["pending", "emitting", "done"]

_MAGIC = b"RG1"
_GROUP = b"g\x00"
_SAMPLE = b"s\x00"


def group_key(uid: str) -> bytes:
    return _GROUP + uid.encode()


def sample_key(trajectory_id: str) -> bytes:
    return _SAMPLE + trajectory_id.encode()


def is_group_key(key: bytes) -> bool:
    return key.startswith(_GROUP)


@dataclass
class GroupState:
    """What the stage knows about one prompt's group (see the module docstring)."""

    uid: str
    partition: int  # source (= changelog) partition
    first_seen: float  # wall time of the first sample's arrival at this stage
    expected: int
    indices: list[int] = field(default_factory=list)
    status: Status = "pending"
    verdict: str | None = None  # EMITTING: "replay" or the drop reason (→ rl.stale)
    out_partition: int | None = None  # EMITTING: partition of the output topic
    since: int | None = None  # EMITTING: that partition's end offset before producing
    outcome: str | None = None  # DONE: the verdict that was produced
    digest: str | None = None  # the prompt's `content_digest`, from its samples (kept when DONE)

    @property
    def complete(self) -> bool:
        return len(self.indices) >= self.expected

    @property
    def unfinished(self) -> bool:
        return self.status != "done"

    def sample_ids(self) -> list[str]:
        return [f"{self.uid}/{i}" for i in sorted(self.indices)]

    def mark_emitting(self, verdict: str, out_partition: int, since: int) -> None:
        self.status, self.verdict = "emitting", verdict
        self.out_partition, self.since = out_partition, since

    def mark_done(self) -> None:
        self.status, self.outcome = "done", self.verdict
        self.verdict, self.out_partition, self.since = None, None, None

    def reopen(self) -> None:
        """EMITTING whose output is missing: back to PENDING, to be finished again."""
        self.status, self.verdict, self.out_partition, self.since = "pending", None, None, None

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "u": self.uid,
            "p": self.partition,
            "t0": self.first_seen,
            "n": self.expected,
            "idx": sorted(self.indices),
            "s": self.status,
            "v": self.verdict,
            "op": self.out_partition,
            "since": self.since,
            "out": self.outcome,
            "d": self.digest,
        }
        return _MAGIC + orjson.dumps(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupState:
        if data[:3] != _MAGIC:
            raise ValueError("not a replay group state")
        body = orjson.loads(data[3:])
        return cls(
            uid=body["u"],
            partition=int(body["p"]),
            first_seen=float(body["t0"]),
            expected=int(body["n"]),
            indices=[int(i) for i in body["idx"]],
            status=body["s"],
            verdict=body.get("v"),
            out_partition=body.get("op"),
            since=body.get("since"),
            outcome=body.get("out"),
            digest=body.get("d"),
        )
