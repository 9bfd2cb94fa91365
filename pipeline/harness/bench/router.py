"""Micro-benchmark of the balancer: acquire+release pairs per second, single-threaded.

Workload (all ids built before the clock starts): `ops` requests; a `sticky_fraction` of them
come from a pool of `ids` session ids (a repeat routes through the sticky LRU), the rest are
one-shot ids never seen before (least-in-flight path, and LRU churn). `window` acquisitions are
kept outstanding, so least-in-flight sees real loads rather than all zeros.

Wired as `rollout bench router --json`: `run(...)` returns a JSON-ready dict.
"""

from __future__ import annotations

import random
import time
from collections import deque

from workers.llm.balancer import Balancer, Replica

__all__ = ["run"]


def run(
    replicas: int = 8,
    ids: int = 10_000,
    ops: int = 200_000,
    sticky_fraction: float = 0.5,
    *,
    window: int = 64,
    deterministic: bool = True,
    sticky_size: int = 65536,
    seed: int = 0,
    repeats: int = 5,
) -> dict[str, object]:
    """Measure acquire+release pairs per second; returns the best of `repeats` runs.

    Keys: `ops_per_s` (wall clock, best run), `cpu_ops_per_s` (process CPU time, which other
    load on a shared machine disturbs less), `ns_per_op`, `sticky_hit_rate`, `max_imbalance`
    (max - min of the requests routed per replica, over all ops, as a fraction of the mean) and
    every setting.
    """
    if replicas < 1 or ids < 1 or ops < 1 or window < 0 or not 0.0 <= sticky_fraction <= 1.0:
        raise ValueError("replicas, ids, ops >= 1; window >= 0; 0 <= sticky_fraction <= 1")
    rng = random.Random(seed)
    pool = [f"session-{i}" for i in range(ids)]
    stream = [
        pool[rng.randrange(ids)] if rng.random() < sticky_fraction else f"oneshot-{k}"
        for k in range(ops)
    ]
    best = best_cpu = float("inf")
    hits = 0
    counts: dict[str, int] = {}
    for _ in range(max(1, repeats)):
        bal = Balancer(sticky_size=sticky_size, deterministic=deterministic)
        bal.add_replicas(Replica(f"r{i}", f"http://127.0.0.1:{8100 + i}") for i in range(replicas))
        acquire, release = bal.acquire, bal.release
        outstanding: deque[tuple[Replica, str]] = deque()
        push, pop = outstanding.append, outstanding.popleft
        per_replica = [0] * replicas
        index = {f"r{i}": i for i in range(replicas)}
        c0, t0 = time.process_time(), time.perf_counter()
        for rid in stream:
            rep = acquire(rid)
            push((rep, rid))
            if len(outstanding) > window:
                r, i = pop()
                release(r, i)
        elapsed = time.perf_counter() - t0
        best_cpu = min(best_cpu, time.process_time() - c0)
        while outstanding:
            r, i = pop()
            release(r, i)
        best = min(best, elapsed)
        # second, untimed pass only for the routing quality numbers
        bal2 = Balancer(sticky_size=sticky_size, deterministic=deterministic)
        bal2.add_replicas(Replica(f"r{i}", f"http://127.0.0.1:{8100 + i}") for i in range(replicas))
        hits = 0
        for rid in stream:
            before = bal2.sticky_replica(rid)
            rep = bal2.acquire(rid)
            hits += before is not None
            per_replica[index[rep.replica_id]] += 1
            bal2.release(rep, rid)
        counts = {f"r{i}": c for i, c in enumerate(per_replica)}
    mean = ops / replicas
    return {
        "ops_per_s": round(ops / best),
        "ns_per_op": round(best / ops * 1e9, 1),
        "cpu_ops_per_s": round(ops / max(best_cpu, 1e-9)),
        "sticky_hit_rate": round(hits / ops, 4),
        "max_imbalance": round((max(counts.values()) - min(counts.values())) / mean, 4),
        "replicas": replicas,
        "ids": ids,
        "ops": ops,
        "sticky_fraction": sticky_fraction,
        "window": window,
        "deterministic": deterministic,
        "sticky_size": sticky_size,
        "seed": seed,
        "repeats": repeats,
    }
