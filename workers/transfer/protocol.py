"""The rendezvous of a weight transfer: what the trainer's store holds, who is granted what.

The trainer runs a `TCPStore` for its whole life and announces `host:port` and a session id
(its run id) with every `PolicyVersion` on `rl.policy`. Under the session's prefix:

    members              append-only, one replica id a line: replicas that ever wanted here
    want/<replica>       `Want`: the replica's latest request for weights (JSON)
    grant/<nonce>        `Grant`: the answer to the want with that nonce (JSON)
    manifest/<n>         the bucket manifest of transfer n (`buckets.plan`)
    group/<n>/<replica>  the process group of transfer n to that replica (gloo's own keys),
                         and `received/<rank>`, set by each receiving rank once it has every
                         bucket (the trainer tears the group down only after)

A replica's controller keeps one want standing: after each load it posts a new one (new nonce,
the version it now serves), so at the trainer's next version every live replica is already
waiting and none is waited for. The trainer grants every standing want when it publishes a
version, and between steps grants the wants of replicas that do not serve the version it holds
(a replica that started late or restarted). A grant names a group of the trainer (rank 0) and
that replica's ranks only: each replica gets a group of its own, so one that dies costs its own
group (the trainer drops it after the timeout) and never another replica's transfer.

Values are JSON, parsed by these classes and checked; nothing is unpickled. Standard library
only: it also runs inside vLLM's workers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "MEMBERS",
    "Grant",
    "Want",
    "grant_key",
    "group_prefix",
    "manifest_key",
    "received_key",
    "want_key",
]

MEMBERS = "members"


def want_key(replica: str) -> str:
    return f"want/{replica}"


def grant_key(nonce: str) -> str:
    return f"grant/{nonce}"


def manifest_key(transfer: int) -> str:
    return f"manifest/{transfer}"


def group_prefix(transfer: int, replica: str) -> str:
    return f"group/{transfer}/{replica}"


def received_key(group: str, rank: int) -> str:
    return f"{group}/received/{rank}"


def _int(data: dict[str, Any], key: str, low: int) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, not {value!r}")
    return value


def _str(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, not {value!r}")
    return value


def _object(raw: bytes | str | dict[str, Any]) -> dict[str, Any]:
    data = json.loads(raw) if isinstance(raw, bytes | str) else raw
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class Want:
    """A replica asks for the trainer's weights.

    `version`: what it serves now (-1: nothing of the trainer's yet: it has just started and
    waits for weights). `ranks`: the processes that receive (a vLLM replica's workers)."""

    replica: str
    nonce: str
    version: int
    ranks: int = 1

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str | dict[str, Any]) -> Want:
        data = _object(raw)
        return cls(
            replica=_str(data, "replica"),
            nonce=_str(data, "nonce"),
            version=_int(data, "version", -1),
            ranks=_int(data, "ranks", 1),
        )


@dataclass(frozen=True)
class Grant:
    """The trainer's answer: join group `group` of `world` ranks as ranks `rank`.. and receive
    the buckets of `manifest`, which are policy version `version`."""

    version: int
    transfer: int
    address: str
    session: str
    group: str
    manifest: str
    rank: int
    world: int
    timeout_s: float
    backend: str = "gloo"

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def loads(cls, raw: bytes | str | dict[str, Any]) -> Grant:
        data = _object(raw)
        timeout = data.get("timeout_s")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout_s must be a positive number, not {timeout!r}")
        backend = data.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, not {backend!r}")
        grant = cls(
            version=_int(data, "version", 0),
            transfer=_int(data, "transfer", 1),
            address=_str(data, "address"),
            session=_str(data, "session"),
            group=_str(data, "group"),
            manifest=_str(data, "manifest"),
            rank=_int(data, "rank", 1),
            world=_int(data, "world", 2),
            timeout_s=float(timeout),
            backend=backend,
        )
        if grant.rank >= grant.world:
            raise ValueError(f"rank {grant.rank} outside a group of {grant.world}")
        return grant
