"""`rollout replica serve --backend vllm` with a wrong interpreter: one clear line, exit 1.

The interpreter comes from `--vllm-python`, else the config key `vllm.python` (environment
`ROLLOUT_VLLM__PYTHON`), else .venv-vllm; these run no vLLM (none is started).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pipeline.cli", "replica", "serve", "--backend", "vllm"]
    done = subprocess.run(
        [*cmd, "--model", str(tmp_path), "--port", "1", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=os.environ | (env or {}),
        timeout=120,
    )
    return done.returncode, done.stderr


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (("--vllm-python", "/no/such/python"), None, "cannot run /no/such/python"),
        ((), {"ROLLOUT_VLLM__PYTHON": sys.executable}, f"{sys.executable} has no vllm module"),
    ],
)
def test_a_wrong_vllm_interpreter_is_one_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str] | None, expected: str
) -> None:
    pytest.importorskip("aiohttp")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vllm")
    status, err = serve(tmp_path, *args, env=env)
    assert status == 1
    (line,) = err.strip().splitlines()
    assert line.startswith("rollout: error: replica backend 'vllm' unavailable: ")
    assert expected in err and "Traceback" not in err
