"""`free_port()`: the one way this code base picks a TCP port to listen on.

The kernel picks it (bind to port 0); the probe socket is closed before the port is returned,
so the caller's own listener gets it. Free a moment ago is all it promises: another process
may take the port in between, which on one machine is rare. Workers and `pipeline/` both use
it (local replicas and brokers, vLLM's internal listener, tests), hence its place here, below
both: no stage, no third-party import.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago ("0.0.0.0": on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
