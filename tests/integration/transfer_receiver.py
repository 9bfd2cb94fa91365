"""A receiving replica in a process of its own, for `test_transfer_failures` (run with -m).

    python -m tests.integration.transfer_receiver --address H:P --session S --replica NAME \
        --layout layout.json --dtype bfloat16 --mode normal --out result.json

It does what a replica's controller and receiver do, without an engine: holds live weights
of `layout` (name → shape) in the dtype it serves, posts a want saying that dtype, waits for
the grant, receives bucket by bucket (`receive_buckets`) and copies each bucket into the live
weights, then writes what it got (a float64 sum per tensor, its dtype, how many buckets) and
its memory: resident set before the transfer and its peak during it (VmHWM, reset before; on
a GPU, `--device cuda:N`, the caching allocator's allocated bytes and their peak).
Run it with `MALLOC_MMAP_THRESHOLD_` set (the test does): buffers then go back to the system
when freed, so the resident set counts what is held, not what glibc keeps for later.

Modes: `normal`; `slow` (sleeps 0.3 s per bucket, and marks `test/<replica>/loaded/<i>` with
the group's order counter after it has copied bucket i); `die_after:N` (SIGKILLs itself once
it has received N buckets: mid-transfer); `never_join` (takes the grant and then does nothing
until killed). On a tree without `receive_buckets` it falls back to `receive` (whole).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from workers.weights.group import store_client
from workers.weights.protocol import MEMBERS, Grant, Want, grant_key, want_key

try:
    from workers.weights.protocol import order_key
    from workers.weights.receive import receive_buckets
except ImportError:  # the code before issue 46: one call, every bucket kept
    from workers.weights.receive import receive

    receive_buckets = None
    order_key = None


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Linux: the peak resident set (VmHWM) starts again from the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--address", "--session", "--replica", "--layout", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mode", default="normal")
    parser.add_argument("--device", default="cpu", help="where it receives and serves")
    parser.add_argument("--backends", default="gloo", help="comma-separated: gloo,nccl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    layout = json.loads(Path(args.layout).read_text())
    # Filled, so every page of the live weights is resident before `rss_before` is read.
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator on this process's own GPU
    live = {n: torch.full(s, 0.5, dtype=dtype, device=device) for n, s in layout.items()}
    store = dist.PrefixStore(args.session + "/", store_client(args.address, 60))
    fields: dict[str, object] = {}
    if receive_buckets is not None:
        fields = {"dtype": args.dtype, "backends": tuple(args.backends.split(","))}
    want = Want(args.replica, uuid.uuid4().hex, -1, 1, **fields)
    store.set(want_key(args.replica), want.dumps())
    store.append(MEMBERS, args.replica + "\n")
    store.wait([grant_key(want.nonce)])
    grant = Grant.loads(store.get(grant_key(want.nonce)))
    manifest = json.loads(store.get(grant.manifest))
    if args.mode == "never_join":
        time.sleep(3600)
    die_after = int(args.mode.split(":")[1]) if args.mode.startswith("die_after:") else None
    before = rss()
    reset_peak()
    if device.type == "cuda":  # on a GPU: what the caching allocator hands out
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.monotonic()
    buckets = 0
    on = {"device": device}
    stream = (
        receive_buckets(grant.as_dict(), **on) if receive_buckets else [receive(grant.as_dict())]
    )
    for bucket in stream:
        buckets += 1
        if die_after is not None and buckets >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        for name, tensor in bucket.items():
            live[name].copy_(tensor)
        del tensor  # no view of this bucket outlives its load
        if args.mode == "slow":
            time.sleep(0.3)
            if order_key is not None:
                loaded = store.add(order_key(grant.group), 1)
                store.set(f"test/{args.replica}/loaded/{buckets - 1}", str(loaded))
        del bucket
    seconds = time.monotonic() - started
    peak = peak_rss() if device.type != "cuda" else torch.cuda.max_memory_allocated(device)
    result = {
        "sums": {name: float(t.cpu().double().sum()) for name, t in live.items()},
        "buckets": buckets,
        "manifest_bytes": manifest.get("total_bytes"),
        "max_bucket": max((b["nbytes"] for b in manifest.get("buckets", [])), default=None),
        "rss_before": before,
        "peak": peak,
        "extra": peak - before,
        "seconds": seconds,
        "group": grant.group,
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
