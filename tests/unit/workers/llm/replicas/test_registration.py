"""The replica backends the registry and `rollout replica serve --help` name all exist."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from workers.llm.replicas import BACKENDS


def test_every_registered_backend_has_its_module() -> None:
    # find_spec locates the module without importing it (vllm need not be installed here).
    missing = [
        name for name, module in BACKENDS.items() if importlib.util.find_spec(module) is None
    ]
    assert not missing, f"registered without a module: {missing}"


def test_replica_serve_offers_exactly_the_registered_backends() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "{" + ",".join(sorted(BACKENDS)) + "}" in out.stdout
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli.main",
            "replica",
            "serve",
            "--backend",
            "sglang",
            "--model",
            "m",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 2 and "invalid choice: 'sglang'" in refused.stderr
