"""A process group made for one transfer, straight from a store: nothing global is touched.

As vLLM's stateless groups do (`vllm.distributed.utils.init_gloo_process_group`), the backend
(`ProcessGroupGloo`, or `ProcessGroupNCCL` on GPUs) is built directly from a `PrefixStore` over
the trainer's `TCPStore`, with an explicit timeout: `torch.distributed.init_process_group` is
never called, so a process may hold any number of such groups one after another (one per
transfer), and the trainer's own default group (FSDP) is never disturbed. Collectives are
called on the backend object with group ranks (`BroadcastOptions.rootRank`), never through
`torch.distributed.broadcast`, which maps global ranks.

Lifecycle: `open_group` → `broadcast` + `settle` per bucket → `close_group(ok=...)`. A group
is shut down explicitly (`shutdown()` after success, `abort()` after a failure), never left to
its destructor: `~ProcessGroupNCCL` aborts work still in flight, which torch's own comment
warns "could lead to corrupted result".

NCCL: `ProcessGroupNCCL` returns at once and the ranks first meet inside the first collective,
where NCCL would wait for a missing rank for ever; and by default torch's watchdog ends the
whole process when a collective times out. The settings chosen (`nccl_settings`, applied once
per process by `nccl_environment` before the first NCCL group, and read by torch in each
group's constructor):

- `TORCH_NCCL_BLOCKING_WAIT=1`: `work.wait()` blocks the calling thread until the collective
  has finished on the GPU, or until the group's timeout, when torch aborts the group's
  communicators and raises `DistBackendError` in that thread; with it torch starts no watchdog
  for the group, so nothing ends the process behind the caller's back.
- `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (CleanUpOnly): where a watchdog does run (a torch that
  starts one anyway), an error aborts the communicators and never tears the process down
  (torch's default, 3, ends it).
- the group's options: `_timeout` = the grant's timeout; `config.blocking = 0` (non-blocking
  communicator init), so creating the communicator at the first collective is waited for with
  that timeout and aborted, instead of blocking in `ncclCommInitRank` while a rank is missing.
- `NCCL_SHARED_ENV` (`NCCL_CUMEM_ENABLE=0`): what vLLM's processes run with; both ends set it.

The trainer sets them when its hub starts (it holds no other NCCL group: broadcast runs with
one trainer process). A vLLM worker sets them at its first NCCL receive, after vLLM built its
own groups, which keep their settings (torch reads them per group, in its constructor).

Together with the join marks (`protocol`), a receiver that never comes, or dies mid-transfer,
costs that one group its timeout and raises where the caller can drop it.

The gloo device listens on the address this process reaches the trainer from
(`local_address`), so the same code works on one host (loopback) and across hosts.

torch and the standard library only: it also runs inside vLLM's workers.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from workers.weights.protocol import NCCL_SHARED_ENV

__all__ = [
    "Backend",
    "broadcast",
    "close_group",
    "local_address",
    "nccl_environment",
    "nccl_options",
    "nccl_settings",
    "open_group",
    "settle",
    "split_address",
    "store_client",
]

Backend = Literal["gloo", "nccl"]

#: Seconds a store's host may take to accept a TCP connection before it counts as gone.
PROBE_S = 5.0

#: torch's ProcessGroupNCCL settings of a transfer group (the module docstring says why).
TORCH_NCCL_SETTINGS = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') → (host, port); ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


def store_client(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the trainer's rendezvous store (raises if it cannot connect in time).

    A store that is gone raises at once what torch raises when it cannot connect
    (`DistNetworkError`, a `RuntimeError`, which every receiver catches): torch's own client
    retries a refused connection for its whole timeout, then once more after a delay (about
    three times `timeout_s` in all), and logs each try with its C++ stack. One plain TCP
    connect first tells a trainer that exited (refused) or a host that does not answer
    (`PROBE_S`) without either."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, PROBE_S)):
            pass
    except OSError as exc:
        raise dist.DistNetworkError(f"no store at {address}: {exc}") from exc
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def local_address(host: str, port: int) -> str:
    """The local IP address this host uses to reach `host:port` (a UDP connect sends
    nothing; it only asks the kernel for the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def nccl_settings() -> dict[str, str]:
    """Every environment variable a transfer's NCCL group needs, with its value."""
    return {**NCCL_SHARED_ENV, **TORCH_NCCL_SETTINGS}


def nccl_environment() -> dict[str, tuple[str | None, str]]:
    """Set `nccl_settings()` in this process's environment; returns name → (value before,
    value now) of those it changed (empty when all were set already). Call it once, before
    the first NCCL group and before the threads that build groups start: it writes the
    environment only when a value differs, so later calls change nothing."""
    changed: dict[str, tuple[str | None, str]] = {}
    for name, value in nccl_settings().items():
        before = os.environ.get(name)
        if before != value:
            os.environ[name] = value
            changed[name] = (before, value)
    return changed


def nccl_options(timeout_s: float) -> Any:
    """The options of a transfer's `ProcessGroupNCCL` (module docstring)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    options.config.blocking = 0
    return options


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

    gloo: blocks until every rank has joined or `timeout_s` passes (then raises, from torch).
    NCCL: returns at once; the ranks meet in the first collective, which fails after
    `timeout_s` (`nccl_options`). Every later operation also fails after `timeout_s`."""
    scoped = dist.PrefixStore(prefix.rstrip("/") + "/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        return dist.ProcessGroupGloo(scoped, rank, world, options)
    if backend == "nccl":
        nccl_environment()  # a no-op once set: the caller set it before its threads started
        return dist.ProcessGroupNCCL(scoped, rank, world, nccl_options(timeout_s))
    raise ValueError(f"unknown backend {backend!r}")


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start broadcasting `tensor` from group rank 0; returns the work (`settle` it)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def settle(work: Any, tensor: torch.Tensor) -> None:
    """Wait until `work` on `tensor` is complete in this process's memory: `wait()` (on NCCL
    with blocking wait, until the GPU has finished it), then the tensor's device stream is
    synchronised, so what follows (a mark in the store, a read on the CPU, a buffer handed
    back) never sees it half-done."""
    work.wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def close_group(group: Any, *, ok: bool) -> None:
    """Shut `group` down explicitly: `shutdown()` once its work is complete (`ok`), else
    `abort()`, which does not wait for a peer that is gone. Errors of the teardown itself are
    swallowed: the transfer's outcome is already decided."""
    try:
        if ok:
            group.shutdown()
        else:
            group.abort()
    except RuntimeError:
        pass
