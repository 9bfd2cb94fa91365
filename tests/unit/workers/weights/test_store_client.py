"""A client of the trainer's store: a store that is gone is told at once, without torch's noise.

When the trainer exits, every replica's sync controller still holds its announced address.
torch's own client would retry the refused connection for about three times its timeout and
log each try with a C++ stack on stderr (the broadcast demo's sync logs filled with them);
`store_client` must raise at once what torch raises (`DistNetworkError`, the `RuntimeError`
the receivers catch) and print nothing, and still connect to a live one.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from workers.weights.group import store_client


def test_a_store_that_is_gone_raises_at_once_and_prints_nothing(capfd) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="no store at"):
        store_client(f"127.0.0.1:{port}", 10.0)
    assert time.monotonic() - started < 2.0
    assert "c10d" not in capfd.readouterr().err


def test_a_live_store_is_connected() -> None:
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = store_client(f"127.0.0.1:{master.port}", 10.0)
    client.set("want", "1")
    assert master.get("want") == b"1"
