"""The trainer's side of one replica's transfer, and the lanes the buckets are packed in.

A *lane* is what the replicas of one transfer that take the same bytes share: the backend
(gloo: CPU buffers; NCCL: buffers on the trainer's device) and the dtype the floating weights
travel in (the dtype the replicas serve: bf16 for a vLLM replica serving bf16 is half the bytes
of the trainer's fp32). Each lane has its manifest and its buffers, packed once by the caller's
thread (`Lane.pack`); each replica's thread (`serve`) sends a bucket as soon as it is packed.

`serve(grant, lane, ...)`, in a thread of its own, for one replica:

1. waits for every receiving rank's `joined` mark (up to `timeout_s`); a replica whose ranks
   do not all join raises `NotJoined` and no group is ever opened with it (on NCCL, the first
   broadcast with a missing rank would wait for ever);
2. opens the trainer's end of the group (rank 0), broadcasts each bucket and settles it (the
   work complete, the device stream synchronised), waits for every rank's `received` mark;
3. shuts the group down explicitly (`close_group`: shutdown after success, abort after a
   failure), so nothing in flight is torn down by a destructor.

Any failure raises (the hub drops that replica only). torch and the standard library only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workers.weights.buckets import alone, as_dtype, pack, plan
from workers.weights.group import Backend, broadcast, close_group, open_group, settle, store_client
from workers.weights.protocol import Grant, joined_key, received_key

__all__ = ["Lane", "NotJoined", "brief", "serve"]


class NotJoined(RuntimeError):
    """Some receiving ranks of a replica did not join within the timeout."""


def brief(exc: BaseException) -> str:
    """torch's errors carry their C++ source location first: keep the message's last line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


@dataclass
class Lane:
    """The buckets of one (backend, dtype): manifest, buffers, and which are packed."""

    backend: Backend
    dtype: str | None  # None: the trainer's own dtypes
    manifest: dict[str, Any]
    snapshot: list[torch.Tensor] = field(default_factory=list)
    packed: list[threading.Event] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.dtype or 'trainer'}"

    @classmethod
    def planned(
        cls,
        backend: Backend,
        dtype: str | None,
        tensors: list[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> Lane:
        """The lane's manifest: tensors of a sixteenth of a bucket or more go alone, and
        unpacked when they travel in their own dtype (`buckets.alone`)."""
        target = getattr(torch, dtype) if dtype else None
        shaped = [(name, as_dtype(t, target)) for name, t in tensors]
        return cls(backend, dtype, plan(shaped, bucket_bytes, max(1 << 20, bucket_bytes // 16)))

    def allocate(
        self, named: dict[str, torch.Tensor], device: torch.device, kept: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Fill `snapshot`: what each bucket is sent from, the tensor itself where it goes
        alone and lies where the backend sends from (gloo: the CPU), else a buffer. gloo's
        buffers are `kept` (the caller's, for the next transfer: the same model plans the same
        buckets, and fresh memory costs a page fault per page, as much as the copy); NCCL's,
        on the device, are not. Returns the buffers to keep."""
        home = device if self.backend == "nccl" else torch.device("cpu")
        buckets = self.manifest["buckets"]
        direct = [alone(b, named) for b in buckets]
        direct = [v if v is not None and v.device == home else None for v in direct]
        sizes = [0 if v is not None else b["nbytes"] for b, v in zip(buckets, direct, strict=True)]
        if self.backend == "nccl":
            buffers = [torch.empty(n, dtype=torch.uint8, device=home) for n in sizes]
        else:
            if [t.numel() for t in kept] != sizes:
                kept = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            buffers = kept
        self.snapshot = [v if v is not None else b for v, b in zip(direct, buffers, strict=True)]
        self.packed = [threading.Event() for _ in buckets]
        for done, view in zip(self.packed, direct, strict=True):
            if view is not None:
                done.set()  # the tensor itself goes: nothing to pack
        return kept if self.backend == "gloo" else []

    def pack(self, named: dict[str, torch.Tensor]) -> None:
        """Pack every bucket not packed yet, in order, marking each once it is complete."""
        for bucket, buffer, done in zip(
            self.manifest["buckets"], self.snapshot, self.packed, strict=True
        ):
            if not done.is_set():
                pack(bucket, named, buffer)
                if buffer.is_cuda:  # complete before another thread sends it
                    torch.cuda.current_stream(buffer.device).synchronize()
                done.set()


def serve(
    grant: Grant,
    lane: Lane,
    *,
    session: str,
    host: str,
    failed: threading.Event,
) -> tuple[float, float]:
    """One replica's transfer (module docstring). Returns (open_s, send_s): from the grant to
    the group formed (the wait for its join included), and from there to its receipt."""
    started = time.monotonic()
    timeout = timedelta(seconds=grant.timeout_s)
    client = dist.PrefixStore(session + "/", store_client(grant.address, grant.timeout_s))
    ranks = range(1, grant.world)
    try:
        client.wait([joined_key(grant.group, r) for r in ranks], timeout)
    except Exception as exc:  # DistStoreError: a timeout
        missing = [r for r in ranks if not client.check([joined_key(grant.group, r)])]
        raise NotJoined(
            f"did not join within {grant.timeout_s:g}s (ranks {missing} of {grant.world - 1})"
        ) from exc
    try:
        group = open_group(
            client,
            grant.group,
            0,
            grant.world,
            timeout_s=grant.timeout_s,
            backend=lane.backend,
            hostname=host,
        )
    except Exception as exc:
        raise RuntimeError(f"group did not form: {brief(exc)}") from exc
    opened, ok = time.monotonic(), False
    try:
        for buffer, done in zip(lane.snapshot, lane.packed, strict=True):
            while not done.wait(0.1):
                if failed.is_set() and not done.is_set():
                    raise RuntimeError("packing failed")
            try:
                settle(broadcast(group, buffer), buffer)
            except Exception as exc:
                raise RuntimeError(f"broadcast failed: {brief(exc)}") from exc
        try:
            client.wait([received_key(grant.group, r) for r in ranks], timeout)
        except Exception as exc:
            raise RuntimeError(f"no receipt: {brief(exc)}") from exc
        ok = True
    finally:
        close_group(group, ok=ok)
    return opened - started, time.monotonic() - opened
