"""`BroadcastPublisher`: a replica that did not join is benched until the next version is
published, and that version gets a checkpoint (its way back), whatever `checkpoint_every`."""

from __future__ import annotations

import uuid

import torch
import torch.distributed as dist

from workers.weights.broadcast import BroadcastPublisher
from workers.weights.config import WeightsConfig
from workers.weights.group import store_client
from workers.weights.protocol import MEMBERS, Want, want_key


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))


def test_a_replica_that_did_not_join_gets_the_next_version_the_checkpoint_way() -> None:
    config = WeightsConfig(timeout_s=0.5, checkpoint_every=10)
    publisher = BroadcastPublisher(config, session=uuid.uuid4().hex[:8])
    hub = publisher.hub
    try:
        store = dist.PrefixStore(hub.session + "/", store_client(hub.address, 5))
        store.set(want_key("r"), Want("r", "n1", -1).dumps())
        store.append(MEMBERS, "r\n")
        assert not publisher.checkpoint_due(1)
        report = publisher.transfer(Model(), 1)  # r wanted and never joins
        assert report.not_joined == ["r"] and hub.benched == {"r"}
        assert publisher.checkpoint_due(2)  # its way back: a checkpoint at the next version
        store.set(want_key("r"), Want("r", "n2", -1).dumps())  # it wants again meanwhile
        assert publisher.serve_waiting(Model(), 1) is None  # benched: not granted
        report = publisher.transfer(Model(), 2)  # published with the checkpoint: skipped
        assert report.receivers == [] and report.dropped == {}
        assert hub.benched == set() and not publisher.checkpoint_due(3)
        assert [w.nonce for w in hub.pending()] == ["n2"]  # granted again from here
    finally:
        publisher.close()
