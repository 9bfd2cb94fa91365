"""Balancer `routing="round_robin"`: rotation over routable replicas, no sticky entries."""

from __future__ import annotations

import pytest

from workers.llm.balancer import Balancer, Replica
from workers.llm.config import LLMClientConfig
from workers.llm.exceptions import NoReplicaError


def make(n: int, **kw: object) -> Balancer:
    bal = Balancer(routing="round_robin", **kw)  # type: ignore[arg-type]
    bal.add_replicas(Replica(f"r{i}", f"http://h:{8000 + i}") for i in range(n))
    return bal


def test_rotates_regardless_of_id_and_load() -> None:
    bal = make(3)
    got = [bal.acquire("same-id").replica_id for _ in range(6)]
    assert got == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert bal.sticky_replica("same-id") is None
    assert bal.inflight("r0") == 2
    for name in ("r0", "r1", "r2"):
        rep = bal.get(name)
        assert rep is not None
        bal.release(rep)
        bal.release(rep)
    assert [bal.inflight(f"r{i}") for i in range(3)] == [0, 0, 0]
    assert bal._low == 0 and bal._nlow == 3


def test_skips_unroutable_and_raises_when_none() -> None:
    bal = make(3)
    bal.mark_unhealthy("r1")
    assert {bal.acquire(str(i)).replica_id for i in range(4)} == {"r0", "r2"}
    bal.remove_replicas(["r0", "r1", "r2"])
    with pytest.raises(NoReplicaError):
        bal.acquire("x")


def test_rejects_unknown_routing() -> None:
    with pytest.raises(ValueError, match="routing"):
        Balancer(routing="random")  # type: ignore[arg-type]
    assert LLMClientConfig().routing == "load"
    assert LLMClientConfig(routing="load").routing == "load"
    assert LLMClientConfig(routing="round_robin").routing == "round_robin"
