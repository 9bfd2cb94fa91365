"""The rendezvous of a weight transfer: what the trainer's store holds, who is granted what.

The trainer runs a `TCPStore` for its whole life and announces `host:port` and a session id
(its run id) with every `PolicyVersion` on `rl.policy`. Under the session's prefix:

    members              append-only, one replica id a line: replicas that ever wanted here
    want/<replica>       `Want`: the replica's latest request for weights (JSON)
    grant/<nonce>        `Grant`: the answer to the want with that nonce (JSON)
    manifest/<n>[/<dtype>]  the bucket manifest of transfer n (`buckets.plan`), one per dtype
                         the tensors travel in (a replica gets its weights in the dtype it
                         serves: no suffix for the trainer's own)
    group/<n>/<replica>  the process group of transfer n to that replica (the backend's own
                         keys) and the marks of its receiving ranks, in this order:
                         `joined/<rank>` (before the rank enters the group: the trainer opens
                         its end, and so broadcasts, only once every rank has joined, and drops
                         a replica whose ranks do not join within the timeout without ever
                         entering a collective with it), `bucket/<i>/<rank>` (bucket i is
                         complete in the receiver's memory: its stream synchronised) and
                         `received/<rank>` (every bucket is; the trainer shuts the group down
                         only after). Each mark's value is the count of `order` at the time
                         (`store.add`): one order over all the group's marks.

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
    "BACKENDS",
    "FLOAT_DTYPES",
    "MEMBERS",
    "NCCL_SHARED_ENV",
    "Grant",
    "Want",
    "bucket_key",
    "grant_key",
    "group_prefix",
    "joined_key",
    "manifest_key",
    "order_key",
    "received_key",
    "want_key",
]

MEMBERS = "members"
BACKENDS = ("gloo", "nccl")
#: NCCL settings both ends of an NCCL transfer must share: vLLM's processes run with
#: NCCL_CUMEM_ENABLE=0 (and the replica launcher sets it for the vLLM it starts), and NCCL weight
#: sync between a trainer and vLLM is documented to fail unless the two match (vLLM's
#: troubleshooting page). The trainer sets these before its first NCCL group and names them in
#: each grant; a receiver whose process differs refuses the grant (it does not join).
NCCL_SHARED_ENV = {"NCCL_CUMEM_ENABLE": "0"}
#: dtype names a replica may announce it serves (floating tensors travel in it).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def want_key(replica: str) -> str:
    return f"want/{replica}"


def grant_key(nonce: str) -> str:
    return f"grant/{nonce}"


def manifest_key(transfer: int, dtype: str | None = None) -> str:
    return f"manifest/{transfer}" + (f"/{dtype}" if dtype else "")


def group_prefix(transfer: int, replica: str) -> str:
    return f"group/{transfer}/{replica}"


def received_key(group: str, rank: int) -> str:
    return f"{group}/received/{rank}"


def joined_key(group: str, rank: int) -> str:
    return f"{group}/joined/{rank}"


def bucket_key(group: str, index: int, rank: int) -> str:
    return f"{group}/bucket/{index}/{rank}"


def order_key(group: str) -> str:
    return f"{group}/order"


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
    waits for weights). `ranks`: the processes that receive (a vLLM replica's workers).
    `dtype`: the dtype it serves (its floating weights travel in it; None: the trainer's).
    `backends`: the groups its processes can join (the hf replica: gloo only; a want that
    does not say is gloo only: NCCL is granted only to a replica that says it takes it)."""

    replica: str
    nonce: str
    version: int
    ranks: int = 1
    dtype: str | None = None
    backends: tuple[str, ...] = ("gloo",)

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str | dict[str, Any]) -> Want:
        data = _object(raw)
        dtype = data.get("dtype")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES} or null, not {dtype!r}")
        backends = data.get("backends", ["gloo"])
        if not isinstance(backends, list) or not set(backends) <= set(BACKENDS):
            raise ValueError(f"backends must be a list of {BACKENDS}, not {backends!r}")
        return cls(
            replica=_str(data, "replica"),
            nonce=_str(data, "nonce"),
            version=_int(data, "version", -1),
            ranks=_int(data, "ranks", 1),
            dtype=dtype,
            backends=tuple(backends),
        )


@dataclass(frozen=True)
class Grant:
    """The trainer's answer: join group `group` of `world` ranks as ranks `rank`.. and receive
    the buckets of `manifest`, which are policy version `version`. `env`: the NCCL settings
    the trainer's process runs with (`NCCL_SHARED_ENV`; NCCL grants only)."""

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
    env: dict[str, str] | None = None

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
        env = data.get("env")
        if env is not None and not (
            isinstance(env, dict) and all(isinstance(v, str) for v in env.values())
        ):
            raise ValueError(f"env must be an object of strings, not {env!r}")
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
            env=env,
        )
        if grant.rank >= grant.world:
            raise ValueError(f"rank {grant.rank} outside a group of {grant.world}")
        return grant
