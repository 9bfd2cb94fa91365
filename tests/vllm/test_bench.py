"""`rollout bench vllm --json`: one object with every figure, from a real vLLM replica.

Small sizes (8 requests of 16 tokens, one round): this checks the benchmark's plumbing and
the figures that do not depend on the machine's speed (logprob drift, prefix hit rate), not
the throughput ratio, which on two shared cores measures the CPU contention between vLLM and
the Kafka broker rather than the pipeline.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.support import REPO, VLLM_CPU_ENV, VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.kafka, pytest.mark.slow]


def test_bench_vllm_prints_one_object(tmp_path: Path, replica_logs: Path) -> None:
    import os

    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli.main",
        "bench",
        "vllm",
        "--json",
        "--requests",
        "8",
        "--concurrency",
        "4",
        "--max-tokens",
        "16",
        "--rounds",
        "1",
        "--vllm-python",
        str(VLLM_PYTHON),
        "--log-dir",
        str(replica_logs / "bench"),
    ]
    env = os.environ | VLLM_CPU_ENV | {"PYTHONPATH": str(REPO)}
    env.pop("ROLLOUT_KAFKA__BOOTSTRAP_SERVERS", None)  # the bench starts its own broker
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.strip().splitlines()
    result = json.loads(line)
    for key in ("direct_tokens_per_s", "adapter_tokens_per_s", "pipeline_tokens_per_s", "ratio"):
        assert result[key] > 0, result
    assert result["logprob_mean_abs_diff"] <= 1e-3 and result["logprob_max_abs_diff"] <= 1e-3
    assert result["prefix_hit_rate"] >= 0.5, result
