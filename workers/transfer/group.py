"""A process group made for one transfer, straight from a store: nothing global is touched.

As vLLM's stateless groups do (`vllm.distributed.utils.init_gloo_process_group`), the backend
(`ProcessGroupGloo`, or `ProcessGroupNCCL` on GPUs) is built directly from a `PrefixStore` over
the trainer's `TCPStore`, with an explicit timeout: `torch.distributed.init_process_group` is
never called, so a process may hold any number of such groups one after another (one per
transfer), a group that failed is simply dropped, and the trainer's own default group (FSDP)
is never disturbed. Collectives are called on the backend object with group ranks
(`BroadcastOptions.rootRank`), never through `torch.distributed.broadcast`, which maps global
ranks.

The gloo device listens on the address this process reaches the trainer from
(`local_address`), so the same code works on one host (loopback) and across hosts.

torch and the standard library only: it also runs inside vLLM's workers.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["Backend", "broadcast", "local_address", "open_group", "split_address", "store_client"]

Backend = Literal["gloo", "nccl"]


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') → (host, port); ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


def store_client(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the trainer's rendezvous store (raises if it cannot connect in time)."""
    host, port = split_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def local_address(host: str, port: int) -> str:
    """The local IP address this host uses to reach `host:port` (a UDP connect sends
    nothing; it only asks the kernel for the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def open_group(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    *,
    timeout_s: float,
    backend: Backend = "gloo",
    hostname: str = "127.0.0.1",
) -> Any:
    """The backend of a fresh group of `world` ranks rendezvousing under `prefix` in `store`.

    Blocks until every rank has joined (each side builds it at once) or `timeout_s` passes
    (then raises, from torch). Every later operation also fails after `timeout_s`."""
    scoped = dist.PrefixStore(prefix.rstrip("/") + "/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        return dist.ProcessGroupGloo(scoped, rank, world, options)
    if backend == "nccl":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(scoped, rank, world, nccl_options)
    raise ValueError(f"unknown backend {backend!r}")


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start broadcasting `tensor` from group rank 0; returns the work (`.wait()` on it)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)
