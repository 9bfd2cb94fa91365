"""Balancer: sticky LRU, least in-flight, stable tie-breaks, membership changes, speed."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zlib

import pytest

from pipeline.harness.bench import router as bench_router
from tests import ROOT
from workers.llm.balancer import Balancer, Replica, stable_hash
from workers.llm.exceptions import NoReplicaError


def make(n: int = 3, **kw: object) -> Balancer:
    bal = Balancer(**kw)  # type: ignore[arg-type]
    bal.add_replicas(Replica(f"r{i}", f"http://h:{8000 + i}") for i in range(n))
    return bal


def check_counts(bal: Balancer) -> None:
    """The O(1)-maintained minimum must equal a brute-force one."""
    counts = bal._inflight
    assert all(c >= 0 for c in counts)
    if counts:
        assert bal._low == min(counts)
        assert bal._nlow == counts.count(min(counts))
    else:
        assert bal._nlow == 0


def test_least_inflight_and_release() -> None:
    bal = make(3)
    got = [bal.acquire(f"id{i}").replica_id for i in range(3)]
    assert sorted(got) == ["r0", "r1", "r2"]  # one each before any doubles up
    held = bal.get(got[0])
    assert held is not None
    for rid in got[1:]:
        rep = bal.get(rid)
        assert rep is not None
        bal.release(rep, "x")
    assert bal.acquire("new").replica_id != held.replica_id  # held one still has 1 in flight
    check_counts(bal)


def test_sticky_wins_over_load() -> None:
    bal = make(2)
    first = bal.acquire("session")
    for i in range(5):
        bal.acquire(f"other{i}")
    assert bal.acquire("session") is first
    assert bal.sticky_replica("session") == first.replica_id
    check_counts(bal)


def test_sticky_lru_is_bounded() -> None:
    bal = make(4, sticky_size=3)
    for i in range(5):
        bal.release(bal.acquire(f"s{i}"), f"s{i}")
    assert len(bal._sticky) == 3
    assert bal.sticky_replica("s0") is None and bal.sticky_replica("s1") is None
    bal.acquire("s2")  # touch: s2 becomes most recent, s3 is evicted next
    bal.acquire("s5")
    assert bal.sticky_replica("s2") is not None and bal.sticky_replica("s3") is None


def test_sticky_entry_dropped_lazily_when_replica_leaves() -> None:
    bal = make(2)
    rep = bal.acquire("sess")
    bal.release(rep, "sess")
    bal.mark_unhealthy(rep)
    assert bal.sticky_replica("sess") == rep.replica_id  # lazily: still there
    moved = bal.acquire("sess")
    assert moved is not rep and bal.sticky_replica("sess") == moved.replica_id
    bal.release(moved, "sess")
    # removal and re-add under the same id is a new replica: old sticky entries do not revive
    bal.remove_replicas([moved.replica_id])
    bal.add_replicas([Replica(moved.replica_id, moved.address)])
    assert bal.acquire("sess") is not moved
    check_counts(bal)


def test_unhealthy_and_back() -> None:
    bal = make(2)
    assert bal.mark_unhealthy("r0") and not bal.mark_unhealthy("r0")
    assert {bal.acquire(f"i{i}").replica_id for i in range(4)} == {"r1"}
    assert bal.mark_healthy("r0") and not bal.mark_healthy("r0")
    assert bal.acquire("fresh").replica_id == "r0"  # least in flight
    check_counts(bal)


def test_counts_survive_leave_and_return() -> None:
    bal = make(2)
    a = bal.acquire("a")
    b = bal.acquire("b")
    assert bal.inflight(a) == 1
    bal.mark_unhealthy(a)
    assert bal.inflight(a) == 1
    bal.release(a, "a")
    bal.release(a, "a")  # a double release never goes negative
    assert bal.inflight(a) == 0
    bal.mark_healthy(a)
    assert bal.inflight(a.replica_id) == 0 and bal.inflight(b) == 1
    bal.remove_replicas([b])
    bal.release(b, "b")  # released after it left: fine
    assert bal.inflight(b) == 0
    check_counts(bal)


def test_no_replica() -> None:
    bal = Balancer()
    with pytest.raises(NoReplicaError):
        bal.acquire("x")
    bal.add_replicas([Replica("r0", "http://h:1")])
    bal.mark_unhealthy("r0")
    with pytest.raises(NoReplicaError):
        bal.acquire("x")


def test_add_updates_address_and_is_bulk() -> None:
    bal = make(2)
    added = bal.add_replicas([Replica("r1", "http://new:9/"), Replica("r9", "http://h:9")])
    assert [r.replica_id for r in added] == ["r9"]
    r1 = bal.get("r1")
    assert r1 is not None and r1.address == "http://new:9"
    assert len(bal.remove_replicas(["r0", "r9", "nope"])) == 2
    assert [r.replica_id for r in bal.routable()] == ["r1"]


def test_random_ops_keep_the_minimum_exact() -> None:
    rng = random.Random(7)
    bal = make(5, sticky_size=50, deterministic=True)
    held: list[tuple[Replica, str]] = []
    for step in range(5000):
        op = rng.random()
        if op < 0.55 or not held:
            if not bal.routable():
                bal.mark_healthy(f"r{rng.randrange(5)}")
            rid = f"s{rng.randrange(80)}"
            rep = bal.acquire(rid)
            assert rep.routable
            held.append((rep, rid))
        elif op < 0.95:
            rep, rid = held.pop(rng.randrange(len(held)))
            bal.release(rep, rid)
        elif op < 0.98:
            bal.mark_unhealthy(f"r{rng.randrange(5)}")
        else:
            bal.mark_healthy(f"r{rng.randrange(5)}")
        if step % 7 == 0:
            check_counts(bal)
    for rep, rid in held:
        bal.release(rep, rid)
    assert all(bal.inflight(r) == 0 for r in bal.replicas())


def test_non_sticky_choice_is_a_least_loaded_one() -> None:
    rng = random.Random(3)
    bal = make(4, deterministic=True)
    held = []
    for i in range(300):
        before = list(bal._inflight)
        rep = bal.acquire(f"u{i}")  # all fresh ids: never sticky
        assert before[rep._slot] == min(before)
        held.append(rep)
        if rng.random() < 0.4:
            bal.release(held.pop(rng.randrange(len(held))))


def test_deterministic_tie_break_uses_a_stable_hash() -> None:
    assert stable_hash("abc") == zlib.crc32(b"abc") == 891568578
    bal = make(4, deterministic=True)
    rep = bal.acquire("req-42")
    assert rep.replica_id == f"r{stable_hash('req-42') % 4}"


def test_deterministic_does_not_depend_on_add_order() -> None:
    ids = [f"q{i}" for i in range(200)]
    a = Balancer(deterministic=True)
    a.add_replicas(Replica(f"r{i}", "x") for i in range(4))
    b = Balancer(deterministic=True)
    b.add_replicas(Replica(f"r{i}", "x") for i in (3, 1, 0, 2))
    assert [a.acquire(i).replica_id for i in ids] == [b.acquire(i).replica_id for i in ids]


def test_non_deterministic_spreads_ties() -> None:
    bal = make(4, deterministic=False)
    got = []
    for i in range(8):
        rep = bal.acquire(f"x{i}")
        got.append(rep.replica_id)
        bal.release(rep)
    assert set(got) == {"r0", "r1", "r2", "r3"}


ROUTE_SCRIPT = """
import json, random
from workers.llm.balancer import Balancer, Replica
bal = Balancer(deterministic=True, sticky_size=300)
bal.add_replicas(Replica(f"replica-{{i}}", "http://h") for i in {order})
rng = random.Random(1)
held, out = [], []
for k in range(3000):
    rid = f"traj-{{rng.randrange(500)}}"
    rep = bal.acquire(rid)
    out.append(rep.replica_id)
    held.append(rep)
    if len(held) > 20:
        bal.release(held.pop(rng.randrange(len(held))))
print(json.dumps(out))
"""


def _routes(hashseed: str, order: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", ROUTE_SCRIPT.format(order=order)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout)


def test_deterministic_across_processes() -> None:
    first = _routes("1", "range(6)")
    second = _routes("4242", "set(range(6))")
    assert first == second
    assert len(set(first)) == 6


def test_bench_router_smoke() -> None:
    out = bench_router.run(replicas=8, ids=1000, ops=20_000, sticky_fraction=0.5, repeats=1)
    assert {"ops_per_s", "replicas", "ids", "ops", "sticky_fraction"} <= out.keys()
    assert out["ops_per_s"] > 0 and 0.3 < out["sticky_hit_rate"] < 0.5  # type: ignore[operator]
    assert out["max_imbalance"] < 0.2  # type: ignore[operator]


# --- roles ------------------------------------------------------------------------------------


def test_a_policy_balancer_never_routes_to_a_judge_and_a_judge_one_only_to_judges() -> None:
    policy = make(2)
    judge = Replica("j0", "http://h:9000", role="judge")
    assert policy.add_replicas([judge]) == []
    assert [r.replica_id for r in policy.routable()] == ["r0", "r1"]
    assert {policy.acquire(f"req-{i}").replica_id for i in range(50)} == {"r0", "r1"}
    judges = Balancer(role="judge")
    assert judges.add_replicas([Replica("p0", "http://h:1"), judge]) == [judge]
    assert {judges.acquire(f"req-{i}").replica_id for i in range(5)} == {"j0"}


def test_a_known_id_that_comes_back_as_a_judge_leaves_the_policy_balancer() -> None:
    bal = make(2)
    bal.acquire("sticky")  # pinned to one of them
    bal.add_replicas([Replica("r0", "http://h:8000", role="judge")])
    assert [r.replica_id for r in bal.replicas()] == ["r1"]
    assert bal.acquire("sticky").replica_id == "r1"


def test_the_client_takes_the_role_from_rl_replicas_and_bare_urls_as_its_own() -> None:
    from schemas.events import ReplicaInfo
    from workers.llm.client import LLMClient

    infos = [
        ReplicaInfo(replica_id="p0", address="http://h:1", backend="hf"),
        ReplicaInfo(replica_id="j0", address="http://h:2", backend="hf", role="judge"),
    ]
    agent = LLMClient(replicas=infos)
    assert [r.replica_id for r in agent.balancer.replicas()] == ["p0"]
    reward = LLMClient(replicas=[*infos, "http://h:3"], role="judge")
    assert [r.replica_id for r in reward.balancer.replicas()] == ["http://h:3", "j0"]
