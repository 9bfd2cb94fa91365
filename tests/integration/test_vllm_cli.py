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

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    (tmp_path / "config.json").write_text("{}")  # passes the model-directory check
    cmd = [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--backend", "vllm"]
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


def test_the_vllm_child_dies_with_a_killed_adapter(tmp_path: Path) -> None:
    """SIGKILL of the replica process (no chance to clean up) still stops its vLLM server.

    The child is a stand-in `vllm` package that records its pid and sleeps (no real vLLM is
    needed to check the process lifecycle); the launcher starts it exactly as it starts vLLM.
    """
    import signal
    import time

    fake = tmp_path / "fake"
    cli = fake / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for pkg in (fake / "vllm", fake / "vllm" / "entrypoints", cli):
        (pkg / "__init__.py").write_text("")
    pidfile = tmp_path / "child.pid"
    (cli / "main.py").write_text(
        f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    cmd = [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--backend", "vllm"]
    (tmp_path / "config.json").write_text("{}")  # passes the model-directory check
    adapter = subprocess.Popen(
        [
            *cmd,
            "--model",
            str(tmp_path),
            "--port",
            str(free_port()),
            "--vllm-python",
            sys.executable,
        ],
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{fake}"},
    )
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline and adapter.poll() is None
            time.sleep(0.1)
        child = int(pidfile.read_text())
        adapter.kill()
        adapter.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = Path(f"/proc/{child}").exists()
        if alive:
            os.kill(child, signal.SIGKILL)
        assert not alive, "the vLLM child outlived its SIGKILLed adapter"
    finally:
        if adapter.poll() is None:
            adapter.kill()
