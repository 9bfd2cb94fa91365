"""`schemas`, the config and the CLI import without torch, vllm or transformers."""

from __future__ import annotations

import subprocess
import sys


def test_light_modules_do_not_import_heavy_ones() -> None:
    code = (
        "import sys, schemas, pipeline.config, pipeline.cli.main, pipeline.clients,"
        " workers.kafka.config, workers.llm.contract;"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'ray') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_help_works() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for command in ("kafka", "topics", "produce", "consume", "bench"):
        assert command in out.stdout
