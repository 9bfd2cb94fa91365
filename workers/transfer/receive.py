"""One receiver's side of a transfer: join the granted group, take every bucket, return views.

`receive(grant)` connects to the trainer's store, reads the manifest, builds the group the
grant names (as rank `grant.rank + rank_offset`: a replica with several receiving processes,
a vLLM replica's workers, gives each its offset), takes the buckets one broadcast each, and
marks the transfer received. It returns name → tensor (views of the received buckets, in the
dtypes the trainer sent); loading them is the caller's (paused, between two steps), so a
transfer that fails half-way leaves the live weights untouched.

Errors: `ValueError` for a grant or manifest that does not hold (bad JSON, sizes that overrun
a bucket), and torch's own (`RuntimeError`, `DistStoreError`) when the trainer cannot be reached
or stops answering within the grant's timeout. Callers translate them at their boundary.
torch and the standard library only: it also runs inside vLLM's workers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from workers.transfer.buckets import unpack
from workers.transfer.group import broadcast, local_address, open_group, split_address, store_client
from workers.transfer.protocol import Grant, received_key

__all__ = ["receive"]


def receive(
    grant: Mapping[str, Any],
    *,
    rank_offset: int = 0,
    device: str | torch.device = "cpu",
    pool: list[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of the granted transfer (see the module docstring).

    `pool`: buffers of the caller's to receive into, reused from one transfer to the next
    (fresh memory costs a page fault per page); the tensors returned are views of them, valid
    until the next `receive` with the same pool. Filled in as needed."""
    g = Grant.loads(dict(grant))
    if g.rank + rank_offset >= g.world:
        raise ValueError(f"rank {g.rank}+{rank_offset} outside a group of {g.world}")
    host, port = split_address(g.address)
    store = dist.PrefixStore(g.session + "/", store_client(g.address, g.timeout_s))
    manifest = json.loads(store.get(g.manifest))
    buckets = manifest.get("buckets") if isinstance(manifest, dict) else None
    if not isinstance(buckets, list):
        raise ValueError(f"manifest {g.manifest} has no bucket list")
    group = open_group(
        store,
        g.group,
        g.rank + rank_offset,
        g.world,
        timeout_s=g.timeout_s,
        backend="nccl" if g.backend == "nccl" else "gloo",
        hostname=local_address(host, port),
    )
    state: dict[str, torch.Tensor] = {}
    for i, bucket in enumerate(buckets):
        nbytes = bucket.get("nbytes") if isinstance(bucket, dict) else None
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"manifest {g.manifest}: a bucket without a valid size")
        if pool is None:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            if len(pool) <= i:
                pool.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
            elif pool[i].numel() < nbytes or pool[i].device != torch.device(device):
                pool[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat = pool[i][:nbytes]
        broadcast(group, flat).wait()
        state.update(unpack(bucket, flat))
    store.set(received_key(g.group, g.rank + rank_offset), "1")
    return state
