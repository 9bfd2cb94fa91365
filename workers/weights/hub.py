"""The trainer's side of weight transfers: the rendezvous store, the grants, the sends.

`TransferHub(host=..., port=..., session=..., timeout_s=..., bucket_bytes=...)` starts the
store (port 0: a free one; `address` is what to announce). `pending(version)` reads the
standing wants (`workers.weights.protocol`), `send(tensors, version, wants)` runs one
transfer to them and returns a `TransferReport`, `close()` stops the store.

One transfer: the wants are sorted into lanes (`workers.weights.send.Lane`: the backend the
replica takes and the dtype it serves), each lane's buckets are planned and its manifest
published, every want is granted; then each lane is packed bucket by bucket (gloo's buffers
kept for the next transfer) while one thread per replica waits for that replica's ranks to
join, forms its group (trainer rank 0 + its ranks, through a store connection of its own),
broadcasts each bucket as soon as it is packed, waits for the replica's `received` marks and
shuts the group down (`send.serve`). The replicas' transfers share nothing but what they send:
one that hangs or dies delays no other.

Invariants:
- A replica that fails (its ranks do not join, its group does not form, a broadcast or its
  marks do not come within `timeout_s`) is dropped from this transfer, with the reason, and the
  others go on: `send` takes at most about `timeout_s` longer than a transfer where all answer,
  and never raises for a replica's failure. On NCCL as on gloo: no collective is entered with a
  replica before all its ranks joined, and the NCCL groups raise in the sending thread instead
  of ending the process (`group` has the torch settings).
- A replica that did not join (`not_joined`, counted in `counts`) is not granted again until
  the next version has been published (`release`): it gets that one the checkpoint way.
- NCCL is granted only to a replica that says it takes it (`Want.backends`); the others get
  gloo from the same transfer.
- A want is granted once: the next transfer to that replica needs its next want.
- The trainer's tensors are read only by `send` and only until it returns; after that they
  may change (the next optimiser step).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workers.weights.exceptions import TransferError
from workers.weights.group import Backend, nccl_environment, nccl_settings
from workers.weights.protocol import (
    MEMBERS,
    NCCL_SHARED_ENV,
    Grant,
    Want,
    grant_key,
    group_prefix,
    manifest_key,
    want_key,
)
from workers.weights.send import Lane, NotJoined, brief, serve

__all__ = ["TransferHub", "TransferReport", "unique_tensors"]

log = logging.getLogger("rollout.transfer.hub")


@dataclass
class TransferReport:
    """What one transfer did: who got version `version`, who was dropped and why (and of
    those, who did not join), the bytes of each lane, and time."""

    version: int
    transfer: int
    receivers: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    not_joined: list[str] = field(default_factory=list)
    bytes: int = 0  # over every lane (each packed once, whatever its replicas)
    buckets: int = 0
    lanes: dict[str, dict[str, Any]] = field(default_factory=dict)  # "gloo/bfloat16": bytes, ...
    open_s: float = 0.0  # the slowest replica's join and group (that formed)
    pack_s: float = 0.0  # copying the weights into the buckets (overlaps the sends)
    send_s: float = 0.0  # from its group formed to its receipt (the slowest receiver)
    seconds: float = 0.0


def unique_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a state dict once each: a tied alias (`lm_head.weight` sharing the
    embedding's storage) is left out, as `save_pretrained` leaves it out of a checkpoint."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = []
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


class TransferHub:
    """The rendezvous store and the sender; see the module docstring."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        session: str,
        timeout_s: float,
        bucket_bytes: int,
        backend: Backend = "gloo",
    ) -> None:
        try:
            self._store = dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )
        except (RuntimeError, OSError) as exc:
            raise TransferError(
                f"cannot start the weight-transfer store on {host}:{port}: {exc}"
            ) from exc
        self.host = host
        self.port = int(self._store.port)
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.session = session
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.backend: Backend = backend
        self._keys: Any = dist.PrefixStore(session + "/", self._store)
        self._members: list[str] = []
        self._members_read = 0
        self._granted: dict[str, str] = {}  # replica → nonce of the want last granted
        self._transfers = 0
        # gloo lanes' packed weights, kept between transfers
        self._buffers: dict[tuple[str, str | None], list[torch.Tensor]] = {}
        self.benched: set[str] = set()  # did not join: not granted until `release`
        self.counts = {"not_joined": 0, "failed": 0}
        if backend == "nccl":  # before this process's first NCCL group; said in one line
            changed = nccl_environment()
            log.info(
                "NCCL weight transfers with %s (set here: %s; vLLM's processes run with %s)",
                " ".join(f"{k}={v}" for k, v in nccl_settings().items()),
                ", ".join(f"{k} {b!r}→{v!r}" for k, (b, v) in changed.items()) or "none",
                " ".join(f"{k}={v}" for k, v in NCCL_SHARED_ENV.items()),
            )

    def close(self) -> None:
        """Stop the store (its server goes with the last reference)."""
        self._keys = self._store = None
        self._buffers = {}

    def release(self, not_joined: list[str]) -> None:
        """After a version was published and sent: the replicas benched so far may be granted
        again, and `not_joined` (of that transfer) are benched until the next one."""
        self.benched = set(not_joined)

    # --- who wants ------------------------------------------------------------------------

    def pending(self, version: int | None = None) -> list[Want]:
        """Standing wants not yet granted; with `version`, only of replicas not serving it."""
        if not self._keys.check([MEMBERS]):
            return []
        raw = self._keys.get(MEMBERS).decode()
        for line in raw[self._members_read :].splitlines():
            if line and line not in self._members:
                self._members.append(line)
        self._members_read = len(raw)
        if not self._members:
            return []
        wants = []
        values = self._keys.multi_get([want_key(m) for m in self._members])
        for member, value in zip(self._members, values, strict=True):
            try:
                want = Want.loads(value)
            except ValueError as exc:
                log.warning("ignoring the want of %s: %s", member, exc)
                continue
            if self._granted.get(want.replica) == want.nonce or want.replica in self.benched:
                continue
            if version is not None and want.version == version:
                continue
            wants.append(want)
        return wants

    def behind(self, version: int) -> list[str]:
        """Replicas that ever wanted here whose latest want is not for `version` yet (one
        waiting for a grant, or loading one and about to want again; or gone)."""
        self.pending()  # reads new members
        if not self._members:
            return []
        values = self._keys.multi_get([want_key(m) for m in self._members])
        late = []
        for member, value in zip(self._members, values, strict=True):
            try:
                if Want.loads(value).version != version:
                    late.append(member)
            except ValueError:
                continue
        return late

    # --- one transfer ---------------------------------------------------------------------

    def send(
        self, tensors: list[tuple[str, torch.Tensor]], version: int, wants: list[Want]
    ) -> TransferReport:
        """Transfer `tensors` as `version` to the replicas of `wants` (module docstring)."""
        started = time.monotonic()
        self._transfers += 1
        n = self._transfers
        report = TransferReport(version=version, transfer=n)
        if not wants:
            return report
        lanes: dict[tuple[str, str | None], Lane] = {}
        grants: dict[str, tuple[Grant, Lane]] = {}
        for want in wants:
            nccl = self.backend == "nccl" and "nccl" in want.backends
            backend: Backend = "nccl" if nccl else "gloo"
            key = (backend, want.dtype if want.dtype != _dtype_name(tensors) else None)
            if key not in lanes:
                lanes[key] = Lane.planned(backend, key[1], tensors, self.bucket_bytes)
                self._keys.set(manifest_key(n, key[1]), json.dumps(lanes[key].manifest))
            lane = lanes[key]
            lane.replicas.append(want.replica)
            grant = Grant(
                version=version,
                transfer=n,
                address=self.address,
                session=self.session,
                group=group_prefix(n, want.replica),
                manifest=manifest_key(n, key[1]),
                rank=1,
                world=1 + want.ranks,
                timeout_s=self.timeout_s,
                backend=backend,
                env=dict(NCCL_SHARED_ENV) if backend == "nccl" else None,
            )
            self._keys.set(grant_key(want.nonce), grant.dumps())
            self._granted[want.replica] = want.nonce
            grants[want.replica] = (grant, lane)
        log.info(
            "transfer %d: version %d to %s (%s)",
            n,
            version,
            sorted(grants),
            ", ".join(f"{lane.name}: {sorted(lane.replicas)}" for lane in lanes.values()),
        )
        named, device = dict(tensors), tensors[0][1].device
        for (backend, dtype), lane in lanes.items():
            kept = lane.allocate(named, device, self._buffers.get((backend, dtype), []))
            if kept:
                self._buffers[(backend, dtype)] = kept
            manifest = lane.manifest
            report.bytes += manifest["total_bytes"]
            report.buckets += len(manifest["buckets"])
            report.lanes[lane.name] = {
                "bytes": manifest["total_bytes"],
                "buckets": len(manifest["buckets"]),
                "replicas": sorted(lane.replicas),
            }
        failed = threading.Event()
        with ThreadPoolExecutor(max_workers=len(grants)) as pool:
            futures = {
                replica: pool.submit(
                    serve, grant, lane, session=self.session, host=self.host, failed=failed
                )
                for replica, (grant, lane) in grants.items()
            }
            try:
                packing = time.monotonic()
                for lane in lanes.values():
                    lane.pack(named)
                report.pack_s = time.monotonic() - packing
            finally:
                failed.set()  # senders still waiting for a bucket give up (only on an error)
            for replica, future in futures.items():
                try:
                    open_s, send_s = future.result()
                except NotJoined as exc:
                    report.not_joined.append(replica)
                    report.dropped[replica] = str(exc)
                except Exception as exc:  # torch's store/backend errors: this replica only
                    report.dropped[replica] = brief(exc)
                else:
                    report.receivers.append(replica)
                    report.open_s = max(report.open_s, open_s)
                    report.send_s = max(report.send_s, send_s)
        for lane in lanes.values():
            lane.snapshot = []  # NCCL's buffers go back to the device's allocator
        for dtype in {dtype for _, dtype in lanes}:
            try:
                self._keys.delete_key(manifest_key(n, dtype))
            except RuntimeError as exc:  # the store is ours: only its own failure lands here
                log.warning("transfer %d: manifest not deleted: %s", n, exc)
        report.receivers.sort()
        report.not_joined.sort()
        self.counts["not_joined"] += len(report.not_joined)
        self.counts["failed"] += len(report.dropped) - len(report.not_joined)
        report.seconds = time.monotonic() - started
        for replica, why in report.dropped.items():
            log.warning("transfer %d: dropped %s: %s", n, replica, why)
        return report


def _dtype_name(tensors: list[tuple[str, torch.Tensor]]) -> str | None:
    """The dtype of the trainer's floating weights (a replica serving it needs no lane of
    its own), None when there are none."""
    for _, tensor in tensors:
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return None
