"""Staleness, the one rule every stage judges by, and groups dropped to `rl.stale`.

A group's staleness is how many policy versions its oldest token lags the version the judging
stage holds for current: `staleness(current_version, min_global_steps)`, never below 0. A
group is past a bound `max_staleness` when its staleness exceeds it (`too_stale`): one
exactly at the bound is kept, one a version past it is not; no bound (None) keeps any. The
replay stage judges against the latest `rl.policy` version it has read, the trainer against
its own version, the agent-loop worker a replica's lag against the latest published version;
the admission gate sizes its capacity so that a group it admits is not `too_stale` when
trained (`workers.agent_loop.admission`).

Why 0 at the bottom: a stage's "current" version can trail the version that generated a
group (the replay stage learns versions from `rl.policy` a moment after replicas load them;
a trainer restored from an older checkpoint than the replicas serve). Such a group is as
fresh as a group can be, so its lag is 0, not negative: a negative number would pass every
`> max_staleness` check, but would also land under the histograms' first bucket, in the
`rl.staleness` header and in `staleness == 0` tests as a number no stage means.

Two stages drop groups, with one header scheme (`schemas.headers`):

    rl.staleness              `staleness(version, min_global_steps)` as the dropping stage judged it
    rl.stale.reason           a `DropReason`
    rl.stale.trainer_version  the trainer's version, only on the trainer's own drops

The replay stage drops a group as `stale` (`too_stale` against the latest `rl.policy`
version), `zero_variance` (DAPO dynamic sampling) or `timeout` (partial group,
`partial_policy: drop`); the trainer drops a group as `stale` against its own version. The
agent-loop's admission gate counts the replay stage's drops from `rl.stale` and skips the
trainer's (it counts those in `PolicyVersion.groups_trained`), told apart by
`rl.stale.trainer_version`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from schemas import headers as h

__all__ = [
    "DropReason",
    "StalePolicy",
    "describe_drop",
    "drop_headers",
    "is_trainer_drop",
    "staleness",
    "too_stale",
]

DropReason = Literal["stale", "zero_variance", "timeout"]
"""Why a group went to `rl.stale` instead of `rl.replay`."""

StalePolicy = Literal["drop", "keep"]
"""What a stage does with a group over `max_staleness`: drop it to `rl.stale`, or keep it."""

Headers = list[tuple[str, bytes]]


def staleness(current_version: int, min_global_steps: int) -> int:
    """Versions `min_global_steps` (a group's or sample's oldest token) lags `current_version`:
    `current_version − min_global_steps`, and 0 when the group is newer than `current_version`
    (see the module doc)."""
    return max(0, current_version - min_global_steps)


def too_stale(lag: int, max_staleness: int | None) -> bool:
    """Whether a group `lag` versions behind is past the bound: `lag > max_staleness`, so
    a group exactly at the bound is kept; never with no bound (None)."""
    return max_staleness is not None and lag > max_staleness


def drop_headers(
    headers: Iterable[tuple[str, bytes]],
    reason: DropReason,
    staleness: int,
    *,
    trainer_version: int | None = None,
) -> Headers:
    """`headers` without any earlier staleness or drop headers, plus this drop's."""
    out = [(k, v) for k, v in headers if k != h.STALENESS and not k.startswith(h.DROPPED_PREFIX)]
    out += [(h.STALENESS, str(staleness).encode()), (h.DROP_REASON, reason.encode())]
    if trainer_version is not None:
        out.append((h.DROP_TRAINER_VERSION, str(trainer_version).encode()))
    return out


def is_trainer_drop(headers: Iterable[tuple[str, bytes]] | None) -> bool:
    """Whether an `rl.stale` record's headers say the trainer dropped it."""
    return any(k == h.DROP_TRAINER_VERSION for k, _ in headers or ())


def describe_drop(headers: Iterable[tuple[str, bytes]] | None) -> str:
    """Who dropped a group and why, with its staleness: "replay: zero_variance (staleness 1)",
    "trainer: stale (staleness 33)"."""
    own = {k: v.decode("utf-8", "replace") for k, v in headers or ()}
    who = "trainer" if h.DROP_TRAINER_VERSION in own else "replay"
    return f"{who}: {own.get(h.DROP_REASON, '?')} (staleness {own.get(h.STALENESS)})"
