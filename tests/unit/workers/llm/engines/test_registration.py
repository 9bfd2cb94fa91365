"""The replica backends the registry and `rollout replica serve --help` name all exist, and a
gated backend (sglang) is offered only where its interpreter finds its package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from workers.llm.engines import BACKENDS, GATED_BACKENDS, backend_names, get_backend
from workers.llm.engines.exceptions import BackendUnavailableError
from workers.ports import free_port


def test_every_registered_backend_has_its_module() -> None:
    # find_spec locates the module without importing it (vllm need not be installed here).
    registered = {**BACKENDS, **GATED_BACKENDS}
    missing = [
        name for name, module in registered.items() if importlib.util.find_spec(module) is None
    ]
    assert not missing, f"registered without a module: {missing}"


def test_replica_serve_offers_exactly_the_registered_backends() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "{" + ",".join(backend_names()) + "}" in out.stdout
    assert "sglang" not in BACKENDS and "sglang" in backend_names()


def test_sglang_is_refused_in_one_line_where_its_interpreter_lacks_the_package() -> None:
    # This interpreter (.venv's) has no sglang package, whatever else is installed here.
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli.main",
            "replica",
            "serve",
            "--backend",
            "sglang",
            "--sglang-python",
            sys.executable,
            "--model",
            "m",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1, refused.stderr
    assert "replica backend 'sglang' unavailable" in lines[0] and "no sglang module" in lines[0]


@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/bin/python"])
def test_gate_refuses_an_interpreter_without_sglang(python: str) -> None:
    with pytest.raises(BackendUnavailableError, match="sglang"):
        get_backend("sglang", python=python)
