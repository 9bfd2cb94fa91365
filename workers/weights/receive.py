"""One receiver's side of a transfer: join the granted group, take every bucket, mark it.

`receive_buckets(grant)` connects to the trainer's store, reads the manifest, announces that
this rank joins (`joined/<rank>`), builds the group the grant names (as rank
`grant.rank + rank_offset`: a replica with several receiving processes, a vLLM replica's
workers, gives each its offset), and yields the buckets one at a time as name → tensor (views
of the bucket, in the dtypes the manifest names: the dtype the replica serves). The next bucket
is received only when the consumer asks for it, into fresh memory (or a `pool` of the caller's),
and this side keeps no reference to a bucket it has handed over: a consumer that loads each
bucket into live weights and drops it holds at most one bucket here, whatever the model's size.

Order (what the trainer and the tests rely on): every bucket is complete in this process's
memory (`group.settle`: the work waited for and the device stream synchronised) before it is
marked (`bucket/<i>/<rank>`) and yielded; `received/<rank>` is set only after the consumer has
taken the last bucket and asked for more; the group is then shut down, explicitly (`abort()`
when the transfer failed or the consumer stopped early). Marks carry the group's `order`.

`receive(grant)` is the whole transfer at once (name → tensor, every bucket kept), for a caller
that must check everything before it touches the live weights (the hf replica).

Errors: `ValueError` for a grant or manifest that does not hold (bad JSON, sizes that overrun
a bucket, an NCCL setting that differs from the trainer's: refused before joining), and
torch's own (`RuntimeError`, `DistStoreError`, `DistBackendError`) when the trainer cannot be
reached or stops answering within the grant's timeout. Callers translate them at their
boundary. torch and the standard library only: it also runs inside vLLM's workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from workers.weights.buckets import unpack
from workers.weights.group import (
    broadcast,
    close_group,
    local_address,
    nccl_environment,
    open_group,
    settle,
    split_address,
    store_client,
)
from workers.weights.protocol import Grant, bucket_key, joined_key, order_key, received_key

__all__ = ["receive", "receive_buckets"]


def receive(
    grant: Mapping[str, Any],
    *,
    rank_offset: int = 0,
    device: str | torch.device = "cpu",
    pool: list[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the granted transfer (module docstring). `pool`: buffers of the
    caller's, one per bucket, reused from one transfer to the next (fresh memory costs a page
    fault per page); the tensors returned are views of them, valid until the next `receive`
    with the same pool."""
    state: dict[str, torch.Tensor] = {}
    for bucket in receive_buckets(grant, rank_offset=rank_offset, device=device, pool=pool):
        state.update(bucket)
    return state


def _check_env(g: Grant) -> None:
    """ValueError when this process's NCCL settings differ from the trainer's: NCCL reads
    them once per process, so a receiver that differs cannot be fixed here, only refused."""
    for name, value in (g.env or {}).items():
        mine = os.environ.get(name)
        if mine is None:
            os.environ[name] = value  # read by NCCL at this process's first communicator
        elif mine != value:
            raise ValueError(f"{name}={mine} here, {value} at the trainer: NCCL needs them equal")


def receive_buckets(
    grant: Mapping[str, Any],
    *,
    rank_offset: int = 0,
    device: str | torch.device = "cpu",
    pool: list[torch.Tensor] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """The buckets of the granted transfer, one at a time (module docstring). With `pool`,
    bucket i is received into `pool[i]` (filled in as needed) instead of fresh memory."""
    g = Grant.loads(dict(grant))
    rank = g.rank + rank_offset
    if rank >= g.world:
        raise ValueError(f"rank {g.rank}+{rank_offset} outside a group of {g.world}")
    backend = "nccl" if g.backend == "nccl" else "gloo"
    if backend == "nccl":
        _check_env(g)
        nccl_environment()
    host, port = split_address(g.address)
    store = dist.PrefixStore(g.session + "/", store_client(g.address, g.timeout_s))
    manifest = json.loads(store.get(g.manifest))
    buckets = manifest.get("buckets") if isinstance(manifest, dict) else None
    if not isinstance(buckets, list) or not all(
        isinstance(b, dict) and isinstance(b.get("nbytes"), int) and b["nbytes"] >= 0
        for b in buckets
    ):
        raise ValueError(f"manifest {g.manifest}: no list of buckets with valid sizes")

    def mark(key: str) -> None:
        store.set(key, str(store.add(order_key(g.group), 1)))

    mark(joined_key(g.group, rank))
    group = open_group(
        store,
        g.group,
        rank,
        g.world,
        timeout_s=g.timeout_s,
        backend=backend,
        hostname=local_address(host, port),
    )
    ok = False
    try:
        for i, bucket in enumerate(buckets):
            flat = _buffer(bucket["nbytes"], device, pool, i)
            settle(broadcast(group, flat), flat)
            views = unpack(bucket, flat)
            del flat  # the consumer holds the only references from here
            mark(bucket_key(g.group, i, rank))
            yield views
            del views
        mark(received_key(g.group, rank))
        ok = True
    finally:
        close_group(group, ok=ok)


def _buffer(
    nbytes: int, device: str | torch.device, pool: list[torch.Tensor] | None, i: int
) -> torch.Tensor:
    if pool is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if len(pool) <= i:
        pool.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
    elif pool[i].numel() < nbytes or pool[i].device != torch.device(device):
        pool[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return pool[i][:nbytes]
