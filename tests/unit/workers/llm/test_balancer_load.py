"""Balancer `routing="load"`: reported load + own requests since the report; unknown ≠ idle."""

from __future__ import annotations

from collections import Counter

from workers.llm.balancer import Balancer, Replica
from workers.llm.fill import fills


def _balancer(*ids: str, **kw: object) -> Balancer:
    bal = Balancer(routing="load", deterministic=True, **kw)  # type: ignore[arg-type]
    bal.add_replicas(Replica(i, f"http://{i}") for i in ids)
    return bal


def test_new_sessions_go_where_the_reported_load_is_lowest() -> None:
    bal = _balancer("a", "b")
    a, b = bal.get("a"), bal.get("b")
    assert a is not None and b is not None
    bal.report(a, 5)  # other processes keep five requests on a
    bal.report(b, 0)
    picks = Counter(bal.acquire(f"s{i}").replica_id for i in range(7))
    # b takes the first five (0..4 since its report), then they alternate at 5
    assert picks == {"b": 6, "a": 1}
    assert b.since == 6 and a.since == 1


def test_a_response_report_replaces_the_requests_counted_since() -> None:
    bal = _balancer("a", "b")
    a = bal.get("a")
    assert a is not None
    bal.report(a, 0)
    reps = [bal.acquire(f"s{i}") for i in range(2)]
    on_a = [r for r in reps if r is a]
    assert a.since == len(on_a)
    bal.release(a, "s", load=7)
    assert (a.load, a.since) == (7, 0)
    bal.release(a, "s")  # no report (a failure): one fewer counted since, never below 0
    assert a.since == 0


def test_sticky_sessions_stay_whatever_the_load() -> None:
    bal = _balancer("a", "b")
    first = bal.acquire("session")
    bal.report(first, 100)
    assert bal.acquire("session") is first


def test_a_silent_replica_is_unknown_not_idle() -> None:
    bal = _balancer("a", "b", load_ttl_s=10.0)
    a, b = bal.get("a"), bal.get("b")
    assert a is not None and b is not None
    bal.report(a, 3)
    bal.report(b, 0)
    b.load_at -= 100.0  # b's last report is too old: unknown from now on
    picks = Counter(bal.acquire(f"s{i}").replica_id for i in range(6))
    # b counts as a's reported 3 plus its own in-flight: shared, not flooded
    assert picks == {"a": 3, "b": 3}


def test_without_any_report_it_is_least_in_flight() -> None:
    bal = _balancer("a", "b", "c")
    picks = Counter(bal.acquire(f"s{i}").replica_id for i in range(9))
    assert picks == {"a": 3, "b": 3, "c": 3}
    assert bal.stats()["inflight"] == {"a": 3, "b": 3, "c": 3}


# ---- capacity: the rank is load / capacity ---------------------------------------------------


def _reported(bal: Balancer, **state: tuple[int, int | None]) -> None:
    for rid, (load, capacity) in state.items():
        rep = bal.get(rid)
        assert rep is not None
        bal.report(rep, load, capacity)


def test_a_big_replica_with_more_load_can_be_the_emptier_one() -> None:
    bal = _balancer("big", "small")
    _reported(bal, big=(8, 16), small=(2, 2))  # a count says small; per capacity big is half full
    picks = [bal.acquire(f"s{i}").replica_id for i in range(9)]
    # big until (8 + 8) / 16 == 2 / 2, then the tie is broken by the id's hash
    assert picks[:8] == ["big"] * 8
    assert bal.fills() == [(8 + picks.count("big")) / 16, (2 + picks.count("small")) / 2]


def test_without_capacities_the_rank_is_the_plain_count() -> None:
    bal = _balancer("a", "b")
    _reported(bal, a=(3, None), b=(1, None))
    assert bal.fills() == [3.0, 1.0]


def test_an_unknown_capacity_is_taken_as_the_smallest_known() -> None:
    bal = _balancer("a", "b", "c")
    _reported(bal, a=(0, 8), b=(0, None), c=(0, 2))
    for i in range(12):
        bal.acquire(f"s{i}")
    # a takes 8, b and c (both as 2) 2 each: every one full once, no more to the unknown one
    assert bal.stats()["inflight"] == {"a": 8, "b": 2, "c": 2}


def test_a_capacity_stays_until_the_replica_reports_another() -> None:
    bal = _balancer("a")
    a = bal.get("a")
    assert a is not None
    bal.report(a, 4, 8)
    bal.release(a, "s", load=2)  # a response without the capacity header
    assert (a.load, a.capacity) == (2, 8)
    bal.report(a, 2, 0)  # nonsense is ignored, not taken as "no room"
    assert a.capacity == 8
    bal.report(a, 2, 4)
    assert a.capacity == 4 and bal.stats()["reported_capacity"] == {"a": 4}


def test_a_silent_replica_counts_its_in_flight_per_capacity_above_the_fullest() -> None:
    bal = _balancer("a", "b", load_ttl_s=10.0)
    a, b = bal.get("a"), bal.get("b")
    assert a is not None and b is not None
    bal.report(a, 4, 8)
    bal.report(b, 0, 4)
    b.load_at -= 100.0  # b's report is stale: unknown, not idle at 0
    assert bal.fills() == [0.5, 0.5]  # 0 in flight / 4 + a's 4 / 8
    bal.acquire("x")  # deterministic tie: either; then the other is strictly lower
    assert sorted(bal.fills()) == [0.5, 0.625] or sorted(bal.fills()) == [0.5, 0.75]


def test_fills_is_pure_and_keeps_order() -> None:
    class R:
        def __init__(self, load: int, at: float, since: int, capacity: int) -> None:
            self.load, self.load_at, self.since, self.capacity = load, at, since, capacity

    reps = [R(6, 5.0, 2, 16), R(-1, 0.0, 0, 0), R(1, 1.0, 0, 2)]
    # fresh after t=2: the first is fresh, the second never reported, the third is stale; the
    # unknown ones sit above the fullest fresh *report* (6 / 16), their size the smallest known
    assert fills(reps, [3, 1, 2], 2.0) == [(6 + 2) / 16, 1 / 2 + 6 / 16, 2 / 2 + 6 / 16]
