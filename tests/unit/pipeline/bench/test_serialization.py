"""The serialization benchmark's figures (its speed is for `rollout bench`, not for tests)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_serialization_prints_one_json_object() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli.main",
            "bench",
            "serialization",
            "--json",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result = json.loads(out.stdout)
    for key in ("ratio", "bytes_per_token", "packed_events_per_s", "baseline_events_per_s"):
        assert key in result
    assert result["tokens"] == 4096
    # Size is deterministic: ids + logprobs as packed base64 are 32/3 bytes per token, plus the
    # envelope.
    assert 32 / 3 <= result["bytes_per_token"] <= 11
    assert result["baseline_bytes_per_token"] > result["bytes_per_token"]
