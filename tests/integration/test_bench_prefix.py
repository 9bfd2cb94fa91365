"""`bench_prefix` end to end on a reduced workload: real `hf` replica subprocesses, both policies.

Hit rates depend only on routing (and, for round-robin, a little on timing), so they are
checked; wall times on a shared machine are not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from pipeline.harness.bench import prefix_routing as bench_prefix
from pipeline.harness.models.tiny import init_model

pytestmark = pytest.mark.slow


def test_sticky_routing_reuses_the_prefix_cache(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", seed=0)
    out = bench_prefix.run(
        str(model), conversations=8, turns=3, replicas=2, concurrency=4, repeats=1
    )
    for key in (
        "sticky_hit_rate",
        "roundrobin_hit_rate",
        "sticky_wall_s",
        "roundrobin_wall_s",
        "ratio",
        "ideal_hit_rate",
    ):
        assert isinstance(out[key], float), key
    assert out["sticky_wall_s"] > 0 and out["roundrobin_wall_s"] > 0
    assert out["sticky_hit_rate"] > out["roundrobin_hit_rate"]
    # sticky: every later turn lands where its previous turn's KV is (the cache is big enough)
    assert out["sticky_hit_rate"] == pytest.approx(out["ideal_hit_rate"], abs=1e-3)
    phases = out["phases"]
    assert phases["sticky"]["prompt_tokens"] == phases["round_robin"]["prompt_tokens"]
    assert sum(phases["sticky"]["requests_per_replica"].values()) == 8 * 3
    assert out["conversations"] == 8 and out["turns"] == 3 and out["replicas"] == 2
