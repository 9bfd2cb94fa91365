"""`free_port()`: the one way this code base picks a TCP port to listen on; and the addresses
a process announces to others (`routable_ip`, `check_reachable`).

The kernel picks it (bind to port 0); the probe socket is closed before the port is returned,
so the caller's own listener gets it. Free a moment ago is all it promises: another process
may take the port in between, which on one machine is rare. Workers and `pipeline/` both use
it (local replicas and brokers, vLLM's internal listener, tests), hence its place here, below
both: no stage, no third-party import.

An address announced to other processes (a replica's on `rl.replicas`, the trainer's
rendezvous for broadcast weights) must be reachable from every node of the run: a process
that listens on every interface (`0.0.0.0`) announces `routable_ip()`, and in a run that
spans nodes (the Ray launcher sets `ROLLOUT_SPANS_NODES=1` in every process it starts when
the cluster has more than one node) a loopback address is refused (`check_reachable`): on
another node it names that node itself, and whoever dials it waits for ever.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

from schemas.errors import RolloutError

__all__ = [
    "SPANS_NODES_ENV",
    "LoopbackAddressError",
    "check_reachable",
    "free_port",
    "is_loopback",
    "routable_ip",
    "spans_nodes",
]

SPANS_NODES_ENV = "ROLLOUT_SPANS_NODES"


class LoopbackAddressError(RolloutError):
    """A loopback address announced in a run that spans nodes."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago ("0.0.0.0": on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def routable_ip() -> str:
    """This machine's address on the network its default route leads to (no packet is sent:
    a UDP socket is only connected); its host name's address, else loopback, without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            return str(sock.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def is_loopback(address: str) -> bool:
    """Whether `address` (a host, or a URL) names this machine only: 127.0.0.0/8, ::1,
    `localhost`; a host name that is none of these is taken as reachable."""
    host = urlsplit(address).hostname if "://" in address else address
    host = (host or "").strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def spans_nodes() -> bool:
    """Whether this process belongs to a run that spans nodes (`SPANS_NODES_ENV`)."""
    return os.environ.get(SPANS_NODES_ENV, "") not in ("", "0")


def check_reachable(address: str, what: str) -> None:
    """LoopbackAddressError (one line naming `what`) when `address` is loopback in a run that
    spans nodes."""
    if spans_nodes() and is_loopback(address):
        raise LoopbackAddressError(
            f"{what} {address} is a loopback address, and this run spans nodes: the other "
            "nodes would dial themselves; give an address they reach (the node's: "
            f"{routable_ip()})"
        )
