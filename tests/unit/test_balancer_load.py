"""Balancer `routing="load"`: reported load + own requests since the report; unknown ≠ idle."""

from __future__ import annotations

from collections import Counter

from workers.llm.balancer import Balancer, Replica


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
