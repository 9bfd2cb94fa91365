"""Trajectory assembly: turn events in, one complete attempt per trajectory out. Pure logic.

The reward stage keeps one `TrajectoryState` per trajectory id (in a changelogged table, as
bytes: `to_bytes`/`from_bytes`). `apply_turn` folds one turn into it:

    (none) ──turn──► ASSEMBLING ──all of turns 0..final present──► complete (caller scores)
    ASSEMBLING ──turn 0 of another attempt──► ASSEMBLING (new attempt; old one superseded)
    complete ──caller: output or dead letter acknowledged──► DONE

Rules (one attempt per trajectory, the first attempt to complete wins):
- a turn of the held attempt is added; a repeated turn index is a duplicate (first kept);
- turn 0 of a different attempt replaces an unfinished attempt (the agent loop restarted the
  trajectory, so the older attempt is presumed dead); the older id is remembered, and its
  later turns are dropped as stale — even one that would have completed first;
- a non-initial turn of an attempt not held is dropped as stale (an attempt's turn 0 always
  precedes its other turns in the trajectory's partition);
- once a trajectory is complete (or DONE) every further turn is dropped; a final one counts
  as a duplicate completion;
- turn 0 of a *different prompt* (its `prompt_digest` differs from the one the state holds:
  another prompt produced under the same uid) changes nothing and is `duplicate_uid`, which
  the stage dead-letters with that cause, whatever the state (DONE keeps the digest for it).
- a trajectory is complete when its final turn (`final=True`, index k) and every turn
  0..k of the held attempt are present, whatever order they arrived in.

The trajectory's `routed_experts` (MoE policies) is the turns' routing folded in turn order,
append-only: each turn's covers the trajectory from position 0, and a position keeps the
routing of the first turn that recorded it (`RoutedExperts.extended_by`); None when no turn
carries any. Turns of different model shapes, or routing past the trajectory's tokens, are a
`DecodeError` (cause `routing`): the trajectory is dead-lettered with that reason.

The trajectory's `images` are turn 0's: the prompt's image references, carried unchanged.

Turns are kept as the raw bytes they arrived in (decoded again only at completion), so the
state costs no re-encoding. A DONE state keeps no turns: it is a small marker that makes
later duplicates cheap to recognise (the stage deletes it after its retention).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

from schemas.codec import decode_as
from schemas.errors import DecodeError
from schemas.events import TurnEvent
from schemas.routing import RoutedExperts

__all__ = [
    "Assembled",
    "Outcome",
    "Status",
    "TrajectoryState",
    "apply_turn",
    "assemble",
]

Status = Literal["assembling", "done"]
Outcome = Literal[
    "added",
    "complete",
    "replaced_attempt",
    "duplicate_turn",
    "stale_attempt",
    "after_done",
    "duplicate_completion",
    "duplicate_uid",
]

_MAGIC = b"RT1"
_HEAD = struct.Struct(">I")
_MAX_SUPERSEDED = 16
_NUMBER = (int, float)


@dataclass
class TrajectoryState:
    """What the stage knows about one trajectory (see the module docstring)."""

    attempt_id: str
    status: Status = "assembling"
    turns: dict[int, bytes] = field(default_factory=dict)
    final_index: int | None = None
    superseded: list[str] = field(default_factory=list)
    outcome: str | None = None  # DONE: "scored" | "failure_scored" | "dead_lettered"
    done_at: float | None = None  # DONE: unix time it was finished (for its retention)
    updated_at: float | None = None  # ASSEMBLING: unix time of its last new turn (abandonment)
    digest: str | None = None  # the prompt's `content_digest`, from turn 0 (kept when DONE)

    @property
    def complete(self) -> bool:
        k = self.final_index
        return k is not None and all(i in self.turns for i in range(k + 1))

    def to_bytes(self) -> bytes:
        order = sorted(self.turns)
        head = orjson.dumps(
            {
                "a": self.attempt_id,
                "s": self.status,
                "f": self.final_index,
                "sup": self.superseded,
                "out": self.outcome,
                "t": self.done_at,
                "u": self.updated_at,
                "d": self.digest,
                "idx": order,
                "len": [len(self.turns[i]) for i in order],
            }
        )
        return b"".join([_MAGIC, _HEAD.pack(len(head)), head, *(self.turns[i] for i in order)])

    @classmethod
    def from_bytes(cls, data: bytes) -> TrajectoryState:
        if data[:3] != _MAGIC:
            raise ValueError("not a trajectory state")
        (size,) = _HEAD.unpack_from(data, 3)
        start = 3 + _HEAD.size
        head: dict[str, Any] = orjson.loads(data[start : start + size])
        pos = start + size
        turns: dict[int, bytes] = {}
        for index, length in zip(head["idx"], head["len"], strict=True):
            turns[index] = bytes(data[pos : pos + length])
            pos += length
        # "emitting" was written by stages before the recovery point moved to the offset
        # commits: its turns are the persisted ones, and the rest are redelivered.
        status = "done" if head["s"] == "done" else "assembling"
        return cls(
            attempt_id=head["a"],
            status=status,
            turns=turns,
            final_index=head["f"],
            superseded=list(head["sup"]),
            outcome=head.get("out"),
            done_at=head.get("t"),
            updated_at=head.get("u"),
            digest=head.get("d"),
        )

    def mark_done(self, outcome: str, at: float | None = None) -> None:
        """DONE keeps only the attempt id, the prompt's digest, the outcome and when (`at`,
        unix time)."""
        self.status = "done"
        self.outcome = outcome
        self.done_at = at
        self.turns = {}


def apply_turn(
    state: TrajectoryState | None, turn: TurnEvent, raw: bytes
) -> tuple[TrajectoryState, Outcome]:
    """Fold one turn into the trajectory's state; the (possibly new) state and what happened."""
    if state is None:
        state = TrajectoryState(attempt_id=turn.attempt_id, digest=turn.prompt_digest)
    elif turn.turn_index == 0 and _other_prompt(state.digest, turn.prompt_digest):
        return state, "duplicate_uid"
    if state.status != "assembling" or state.complete:
        # Scored, or complete and being scored: nothing changes the trajectory any more.
        return state, ("duplicate_completion" if turn.final else "after_done")
    if turn.attempt_id != state.attempt_id:
        if turn.attempt_id in state.superseded or turn.turn_index != 0:
            return state, "stale_attempt"
        superseded = [*state.superseded, state.attempt_id][-_MAX_SUPERSEDED:]
        digest = state.digest or turn.prompt_digest
        state = TrajectoryState(attempt_id=turn.attempt_id, superseded=superseded, digest=digest)
        _add(state, turn, raw)
        return state, ("complete" if state.complete else "replaced_attempt")
    if turn.turn_index in state.turns:
        return state, "duplicate_turn"
    _add(state, turn, raw)
    return state, ("complete" if state.complete else "added")


def _other_prompt(held: str | None, given: str | None) -> bool:
    """Turn 0 of another prompt under this trajectory's uid (unknowable without both)."""
    return held is not None and given is not None and held != given


def _add(state: TrajectoryState, turn: TurnEvent, raw: bytes) -> None:
    state.turns[turn.turn_index] = raw
    if turn.turn_index == 0 and state.digest is None:
        state.digest = turn.prompt_digest  # a later turn arrived first
    if turn.final:
        state.final_index = turn.turn_index


def _routing(turns: list[TurnEvent], positions: int) -> RoutedExperts | None:
    """The turns' routing, append-only in turn order (module docstring)."""
    folded: RoutedExperts | None = None
    for turn in turns:
        piece = turn.routed_experts
        if piece is None:
            continue
        try:
            folded = piece if folded is None else folded.extended_by(piece)
        except ValueError as exc:
            raise DecodeError(f"turn {turn.turn_index}: {exc}", cause="routing") from exc
    if folded is not None and folded.tokens > positions:
        raise DecodeError(
            f"routed_experts cover {folded.tokens} positions, past the trajectory's {positions}",
            cause="routing",
        )
    return folded


@dataclass
class Assembled:
    """A complete trajectory, everything but the score (`ScoredTrajectory` minus reward)."""

    fields: dict[str, Any]
    ground_truth: Any  # as the dataset wrote it: any JSON value (`scorers.truth`)
    extra_info: dict[str, Any]
    data_source: str
    started_at: float | None = None  # unix time of turn 0 (its `created_at`)


def assemble(state: TrajectoryState, decoded: dict[int, TurnEvent] | None = None) -> Assembled:
    """Build the trajectory from a complete state; `DecodeError` if its turns do not fit.

    `decoded` may hold turns already decoded (by index, of this state's attempt) to skip
    decoding their bytes again.
    """
    if not state.complete or state.final_index is None:
        raise ValueError("assemble() needs a complete trajectory")
    known = decoded or {}
    turns = [
        known[i] if i in known else decode_as(state.turns[i], TurnEvent)
        for i in range(state.final_index + 1)
    ]
    first, last = turns[0], turns[-1]
    if first.prompt_ids is None or first.data_source is None:
        raise DecodeError("turn 0 carries no prompt_ids or data_source", cause="incomplete_turn0")
    if last.extra_fields is None or last.num_turns is None:
        raise DecodeError("the final turn carries no totals", cause="incomplete_final")
    lengths = [len(t.token_ids) for t in turns]
    response_ids = np.concatenate([t.token_ids for t in turns])
    mask = np.repeat(np.array([t.loss_mask for t in turns], dtype="u1"), lengths)
    logprobs = np.zeros(len(response_ids), dtype="<f4")  # 0 where the policy sampled nothing
    end = 0
    for t, n in zip(turns, lengths, strict=True):
        end += n
        if t.logprobs is not None and t.loss_mask:
            logprobs[end - n : end] = t.logprobs
    # Within each turn min <= max, so the span over all turns is ordered too. The final
    # turn's totals normally span every turn already: then they are kept as they are.
    extra_fields = last.extra_fields
    low = min(extra_fields.min_global_steps, *(t.min_global_steps for t in turns))
    high = max(extra_fields.max_global_steps, *(t.max_global_steps for t in turns))
    if (low, high) != (extra_fields.min_global_steps, extra_fields.max_global_steps):
        extra_fields = extra_fields.model_copy(
            update={"min_global_steps": low, "max_global_steps": high}
        )
    reward_spec = first.reward_model
    fields = {
        "uid": first.uid,
        "trajectory_id": first.trajectory_id,
        "sample_index": first.sample_index,
        "attempt_id": first.attempt_id,
        "data_source": first.data_source,
        "prompt_ids": first.prompt_ids,
        "response_ids": response_ids,
        "response_mask": mask,
        "response_logprobs": logprobs,
        "num_turns": last.num_turns,
        "tool_rewards": [t.tool_reward for t in turns if t.tool_reward is not None],
        "turn_scores": [
            float(t.metrics["turn_score"])
            for t in turns
            if isinstance(t.metrics.get("turn_score"), _NUMBER)
        ],
        "group_size": first.group_size,
        "prompt_digest": first.prompt_digest,
        "finish_reason": next((t.stop_reason for t in reversed(turns) if t.loss_mask), None),
        "extra_fields": extra_fields,
        "routed_experts": _routing(turns, len(first.prompt_ids) + len(response_ids)),
        # Plain data like the rest (a custom scorer gets `fields` as JSON); None: text prompt.
        "images": [r.model_dump(mode="json") for r in first.images] if first.images else None,
    }
    return Assembled(
        fields=fields,
        ground_truth=reward_spec.ground_truth if reward_spec is not None else None,
        extra_info=dict(first.extra_info or {}),
        data_source=first.data_source,
        started_at=first.created_at,
    )
