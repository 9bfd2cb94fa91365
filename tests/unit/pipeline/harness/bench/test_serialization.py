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


def test_an_image_prompt_by_reference_costs_a_reference_not_the_image() -> None:
    from pipeline.harness.bench.serialization import image_figures

    figures = image_figures(side=64)
    for topic in ("prompt", "turn0", "group"):
        by_ref, inline = (
            figures[f"image_{topic}_bytes_by_ref"],
            figures[f"image_{topic}_bytes_inline"],
        )
        # Inline adds the image's base64 (4/3 of its bytes) to every copy; a reference, none.
        assert inline - by_ref > figures["image_bytes"]
    assert figures["image_prompt_bytes_by_ref"] < 1024 < figures["image_bytes"]
