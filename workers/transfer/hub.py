"""The trainer's side of weight transfers: the rendezvous store, the grants, the sends.

`TransferHub(host=..., port=..., session=..., timeout_s=..., bucket_bytes=...)` starts the
store (port 0: a free one; `address` is what to announce). `pending(version)` reads the
standing wants (`workers.transfer.protocol`), `send(tensors, version, wants)` runs one
transfer to them and returns a `TransferReport`, `close()` stops the store.

One transfer: plan the buckets and publish the manifest, grant every want, then pack the
small tensors bucket by bucket into buffers (with gloo kept for the next transfer) while one
thread per replica forms that replica's group (trainer rank 0 + its ranks, through a store
connection of its own), broadcasts each bucket as soon as it is packed (a tensor of a
sixteenth of a bucket or more goes alone, straight from its own memory), and waits for the
replica's `received` marks. The replicas' transfers share nothing but what they send: one that
hangs or dies delays no other.

Invariants:
- A replica that fails (its group does not form, a broadcast or its marks do not come within
  `timeout_s`) is dropped from this transfer, with the reason, and the others go on: `send`
  takes at most about `timeout_s` longer than a transfer where all answer, and never raises
  for a replica's failure.
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

from workers.transfer.buckets import alone, pack, plan
from workers.transfer.exceptions import TransferError
from workers.transfer.group import Backend, broadcast, open_group, store_client
from workers.transfer.protocol import (
    MEMBERS,
    Grant,
    Want,
    grant_key,
    group_prefix,
    manifest_key,
    received_key,
    want_key,
)

__all__ = ["TransferHub", "TransferReport", "unique_tensors"]

log = logging.getLogger("rollout.transfer.hub")


@dataclass
class TransferReport:
    """What one transfer did: who got version `version`, who was dropped and why, and time."""

    version: int
    transfer: int
    receivers: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    buckets: int = 0
    open_s: float = 0.0  # forming a replica's group (the slowest that formed)
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
        self._buffers: list[torch.Tensor] = []  # the packed weights, kept between transfers

    def close(self) -> None:
        """Stop the store (its server goes with the last reference)."""
        self._keys = self._store = None
        self._buffers = []

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
            if self._granted.get(want.replica) == want.nonce:
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
        # Tensors of a sixteenth of a bucket or more go alone, unpacked (`buckets.alone`).
        manifest = plan(tensors, self.bucket_bytes, max(1 << 20, self.bucket_bytes // 16))
        report.bytes, report.buckets = manifest["total_bytes"], len(manifest["buckets"])
        self._keys.set(manifest_key(n), json.dumps(manifest))
        grants = {}
        for want in wants:
            grant = Grant(
                version=version,
                transfer=n,
                address=self.address,
                session=self.session,
                group=group_prefix(n, want.replica),
                manifest=manifest_key(n),
                rank=1,
                world=1 + want.ranks,
                timeout_s=self.timeout_s,
                backend=self.backend,
            )
            self._keys.set(grant_key(want.nonce), grant.dumps())
            self._granted[want.replica] = want.nonce
            grants[want.replica] = grant
        log.info("transfer %d: version %d to %s", n, version, sorted(grants))
        buckets, named = manifest["buckets"], dict(tensors)
        direct = [alone(b, named) for b in buckets]
        snapshot = self._snapshot(buckets, direct, tensors[0][1].device)
        packed = [threading.Event() for _ in buckets]
        for done, view in zip(packed, direct, strict=True):
            if view is not None:
                done.set()  # the tensor itself goes: nothing to pack
        failed = threading.Event()
        with ThreadPoolExecutor(max_workers=len(grants)) as pool:
            futures = {
                replica: pool.submit(self._serve, grant, snapshot, packed, failed)
                for replica, grant in grants.items()
            }
            try:
                packing = time.monotonic()
                for bucket, buffer, done in zip(buckets, snapshot, packed, strict=True):
                    if not done.is_set():
                        pack(bucket, named, buffer)
                        done.set()
                report.pack_s = time.monotonic() - packing
            finally:
                failed.set()  # senders still waiting for a bucket give up (only on an error)
            for replica, future in futures.items():
                try:
                    open_s, send_s = future.result()
                except Exception as exc:  # torch's store/gloo errors: this replica only
                    report.dropped[replica] = _brief(exc)
                else:
                    report.receivers.append(replica)
                    report.open_s = max(report.open_s, open_s)
                    report.send_s = max(report.send_s, send_s)
        try:
            self._keys.delete_key(manifest_key(n))
        except RuntimeError as exc:  # the store is ours: only its own failure lands here
            log.warning("transfer %d: manifest not deleted: %s", n, exc)
        report.receivers.sort()
        report.seconds = time.monotonic() - started
        for replica, why in report.dropped.items():
            log.warning("transfer %d: dropped %s: %s", n, replica, why)
        return report

    def _snapshot(
        self,
        buckets: list[dict[str, Any]],
        direct: list[torch.Tensor | None],
        device: torch.device,
    ) -> list[torch.Tensor]:
        """What each bucket is sent from: the tensor itself when it goes alone and lies where
        the backend sends from (gloo: the CPU), else a buffer it is packed into. With gloo the
        buffers are kept for the next transfer (the same model plans the same buckets: fresh
        memory costs a page fault per page, as much as the copy); NCCL's, on the GPU, not."""
        home = device if self.backend == "nccl" else torch.device("cpu")
        for i, view in enumerate(direct):
            if view is not None and view.device != home:
                direct[i] = None
        sizes = [
            0 if view is not None else b["nbytes"] for b, view in zip(buckets, direct, strict=True)
        ]
        if self.backend == "nccl":
            buffers = [torch.empty(n, dtype=torch.uint8, device=home) for n in sizes]
        else:
            if [t.numel() for t in self._buffers] != sizes:
                self._buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            buffers = self._buffers
        return [
            view if view is not None else buffer
            for view, buffer in zip(direct, buffers, strict=True)
        ]

    def _serve(
        self,
        grant: Grant,
        snapshot: list[torch.Tensor],
        packed: list[threading.Event],
        failed: threading.Event,
    ) -> tuple[float, float]:
        """One replica's transfer, in a thread of its own: form its group, broadcast each
        bucket as soon as it is packed, wait for its receipt. Returns (open_s, send_s)."""
        started = time.monotonic()
        client = dist.PrefixStore(self.session + "/", store_client(self.address, self.timeout_s))
        try:
            group = open_group(
                client,
                grant.group,
                0,
                grant.world,
                timeout_s=self.timeout_s,
                backend=self.backend,
                hostname=self.host,
            )
        except Exception as exc:
            raise RuntimeError(f"group did not form: {_brief(exc)}") from exc
        opened = time.monotonic()
        for buffer, done in zip(snapshot, packed, strict=True):
            while not done.wait(0.1):
                if failed.is_set() and not done.is_set():
                    raise RuntimeError("packing failed")
            try:
                broadcast(group, buffer).wait()
            except Exception as exc:
                raise RuntimeError(f"broadcast failed: {_brief(exc)}") from exc
        keys = [received_key(grant.group, rank) for rank in range(1, grant.world)]
        try:
            client.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise RuntimeError(f"no receipt: {_brief(exc)}") from exc
        return opened - started, time.monotonic() - opened


def _brief(exc: BaseException) -> str:
    """torch's errors carry their C++ source location first: keep the message's last line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]
