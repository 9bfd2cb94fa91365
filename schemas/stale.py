"""Groups dropped to `rl.stale`: why (`DropReason`), the policy (`StalePolicy`), the headers.

Two stages drop groups, with one header scheme (`schemas.headers`):

    rl.staleness              `version − min_global_steps` as the dropping stage judged it
    rl.stale.reason           a `DropReason`
    rl.stale.trainer_version  the trainer's version, only on the trainer's own drops

The replay stage drops a group as `stale` (over `max_staleness` against the latest
`rl.policy` version), `zero_variance` (DAPO dynamic sampling) or `timeout` (partial group,
`partial_policy: drop`); the trainer drops a group as `stale` against its own version. The
agent-loop's admission gate counts the replay stage's drops from `rl.stale` and skips the
trainer's (it counts those in `PolicyVersion.groups_trained`), told apart by
`rl.stale.trainer_version`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from schemas import headers as h

__all__ = ["DropReason", "StalePolicy", "describe_drop", "drop_headers", "is_trainer_drop"]

DropReason = Literal["stale", "zero_variance", "timeout"]
"""Why a group went to `rl.stale` instead of `rl.replay`."""

StalePolicy = Literal["drop", "keep"]
"""What a stage does with a group over `max_staleness`: drop it to `rl.stale`, or keep it."""

Headers = list[tuple[str, bytes]]


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
