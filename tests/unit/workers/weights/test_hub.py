"""`TransferHub` and `receive` over real gloo groups on loopback (no broker, no replica).

Receivers run in threads of this process, each through its own store connection, exactly as
a replica's would: wants, grants, one group per receiver, the buckets, the receipts. A
receiver that was granted but never joins is dropped after the timeout (never joined: no group
is opened with it) and costs the others nothing; a want is granted once; `pending(version)`
and `behind(version)` say who lacks what.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist

from workers.weights.group import store_client
from workers.weights.hub import TransferHub, unique_tensors
from workers.weights.protocol import MEMBERS, Grant, Want, grant_key, want_key
from workers.weights.receive import receive

TIMEOUT_S = 3.0


@pytest.fixture
def hub() -> Any:
    hub = TransferHub(
        host="127.0.0.1",
        port=0,
        session=uuid.uuid4().hex[:8],
        timeout_s=TIMEOUT_S,
        bucket_bytes=4096,
    )
    yield hub
    hub.close()


def _want(hub: TransferHub, replica: str, version: int) -> tuple[Any, Want]:
    """What a replica's controller does: post a want, join the members (own connection)."""
    store = dist.PrefixStore(hub.session + "/", store_client(hub.address, TIMEOUT_S))
    want = Want(replica, uuid.uuid4().hex, version)
    store.set(want_key(replica), want.dumps())
    store.append(MEMBERS, replica + "\n")
    return store, want


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(50, 8, generator=g)
    return {
        "embed.weight": embed,
        "layer.weight": torch.randn(8, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g),
        "head.weight": embed,
    }


def test_two_receivers_get_every_tensor_and_one_that_never_joins_is_dropped(hub) -> None:
    state = _model()
    tensors = unique_tensors(state)
    assert [name for name, _ in tensors] == ["embed.weight", "layer.weight", "layer.bias"]
    wants = {name: _want(hub, name, -1) for name in ("r0", "r1", "dead")}
    assert sorted(w.replica for w in hub.pending()) == ["dead", "r0", "r1"]
    got: dict[str, dict[str, torch.Tensor]] = {}

    def replica(name: str) -> None:
        store, want = wants[name]
        store.wait([grant_key(want.nonce)])
        got[name] = receive(Grant.loads(store.get(grant_key(want.nonce))).as_dict())

    threads = [threading.Thread(target=replica, args=(name,)) for name in ("r0", "r1")]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    report = hub.send(tensors, 5, hub.pending())
    took = time.monotonic() - started
    for thread in threads:
        thread.join()
    assert report.receivers == ["r0", "r1"] and list(report.dropped) == ["dead"]
    assert "did not join" in report.dropped["dead"] and report.not_joined == ["dead"]
    assert hub.counts == {"not_joined": 1, "failed": 0}
    assert took < TIMEOUT_S + 2  # the dead one cost its own timeout, once, in parallel
    assert report.buckets == 1 and report.bytes >= sum(t.numel() * 4 for _, t in tensors)
    for name in ("r0", "r1"):
        assert set(got[name]) == {"embed.weight", "layer.weight", "layer.bias"}
        for key, tensor in got[name].items():
            assert torch.equal(tensor, state[key])
    assert hub.pending() == []  # each want was granted once


def test_pending_and_behind_follow_what_replicas_serve(hub) -> None:
    _want(hub, "r0", 4)
    _want(hub, "r1", 5)
    assert [w.replica for w in hub.pending(version=5)] == ["r0"]
    assert hub.behind(5) == ["r0"]
    _want(hub, "r0", 5)  # the same replica again (a new want, no second member entry)
    assert hub.behind(5) == [] and hub.pending(version=5) == []


def test_nothing_to_send_to_nobody(hub) -> None:
    report = hub.send(unique_tensors(_model()), 1, [])
    assert report.receivers == [] and report.dropped == {} and report.bytes == 0
