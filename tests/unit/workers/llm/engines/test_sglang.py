"""The sglang launcher: its one-line start failure on SGLang's own output, and its process
model with a stand-in `sglang` package.

The failure lines are excerpts of real SGLang 0.5.23 runs on this project's development machine
(2 AVX2 cores, no GPU; README "SGLang"), where its server cannot start. The stand-in is written
into a temporary directory put first on PYTHONPATH, so the registry's gate finds an `sglang`
package in this interpreter; its `sglang.launch_server` answers the endpoints the launcher
waits on, records its argv and pid, and exits on SIGTERM. This checks the process model
(adapter first, child in its own process group, health wait, clean stop), not SGLang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.launch.replicas import wait_healthy
from tests import ROOT
from tests.http import http
from workers.llm.engines.sglang.server import start_failure
from workers.ports import free_port

# SGLANG_USE_CPU_ENGINE=1 ... --device cpu: the CPU engine imports sgl_kernel's CPU ops, and
# PyPI's sglang-kernel is the CUDA build. The exception's message starts on the next line.
CPU_ENGINE_RUN = """\
  File "/work/main/.venv-sglang/lib/python3.11/site-packages/sgl_kernel/load_utils.py", line 192
    raise ImportError(error_msg)
ImportError:

[sgl_kernel] CRITICAL: Could not load any common_ops library!

Attempted locations:
3. Standard Python import: common_ops - failed

Error details from previous import attempts:
- ImportError: libcuda.so.1: cannot open shared object file: No such file or directory
- ModuleNotFoundError: No module named 'common_ops'
"""

# --device cpu --attention-backend torch_native ... without the CPU engine: the scheduler
# dies loading the model (rotary embedding's fallback kernel is vLLM's).
TORCH_NATIVE_RUN = """\
[2026-12-02 07:58:48] Scheduler hit an exception: Traceback (most recent call last):
    from vllm._custom_ops import rotary_embedding
ModuleNotFoundError: No module named 'vllm'

[2026-12-02 07:58:48] Received sigquit from a child process. It usually means the child failed.
[2026-12-02 07:58:48] kill_process_tree called: parent_pid=31913, include_parent=True, pid=31913
"""


def test_a_bare_exception_line_is_joined_with_its_message() -> None:
    assert start_failure(CPU_ENGINE_RUN.splitlines()) == (
        "ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library!"
    )


def test_the_last_exception_line_is_the_cause() -> None:
    assert start_failure(TORCH_NATIVE_RUN.splitlines()) == (
        "ModuleNotFoundError: No module named 'vllm'"
    )


def test_no_exception_no_cause() -> None:
    assert start_failure(["[2026-12-02 07:58:00] Init parallel begin.", ""]) is None


FAKE_SERVER = """
import json, os, sys
from aiohttp import web

args = sys.argv[1:]
with open(os.environ["FAKE_SGLANG_RECORD"], "w") as f:
    json.dump({"argv": args, "pid": os.getpid()}, f)
if os.environ.get("FAKE_SGLANG_CRASH"):
    print("ImportError:", file=sys.stderr)
    print("", file=sys.stderr)
    print("[sgl_kernel] CRITICAL: Could not load any common_ops library!", file=sys.stderr)
    sys.exit(1)

async def health(_r):
    return web.Response()

async def models(_r):
    return web.json_response({"data": [{"id": "tiny", "max_model_len": 512}]})

async def server_info(_r):
    return web.json_response({"internal_states": [{"effective_max_running_requests_per_dp": 6}]})

async def generate(r):
    body = await r.json()
    n = body["sampling_params"]["max_new_tokens"]
    meta = {"finish_reason": {"type": "length", "length": n}, "prompt_tokens": 2,
            "output_token_logprobs": [[-0.5, t, None] for t in range(n)]}
    return web.json_response({"text": "", "output_ids": list(range(n)), "meta_info": meta})

app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
app.router.add_get("/server_info", server_info)
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(args[args.index("--port") + 1]), print=None)
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SERVER)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # a model directory, no tokenizer
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(ROOT)])
    env["FAKE_SGLANG_RECORD"] = str(tmp_path / "record.json")
    env["TMPDIR"] = str(tmp_path)
    return env


def _launch(tmp_path: Path, env: dict[str, str], port: int, **popen: Any) -> Any:
    cmd = [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--backend", "sglang"]
    cmd += ["--model", str(tmp_path / "model"), "--sglang-python", sys.executable]
    cmd += ["--port", str(port), "--replica-id", "s-test", "--version", "2"]
    cmd += ["--sglang-arg=--log-level=debug"]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, **popen)


@pytest.mark.slow
def test_launcher_serves_the_contract_and_stops_its_child(
    tmp_path: Path, stand_in: dict[str, str]
) -> None:
    port = free_port()
    proc = _launch(tmp_path, stand_in, port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, lambda: proc.poll() is None, 60, name="the launcher")
        status, body = http(url + "/health", timeout=5)
        assert (status, body) == (
            200,
            {"status": "ok", "version": 2, "load": 0, "capacity": 6, "transfer_backends": []},
        )
        record = json.loads((tmp_path / "record.json").read_text())
        argv = record["argv"]
        assert argv[argv.index("--weight-version") + 1] == "2"
        assert "--skip-tokenizer-init" in argv and argv[-1] == "--log-level=debug"
        status, body = http(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 3}, timeout=5)
        assert status == 200 and body["choices"][0]["token_ids"] == [0, 1, 2]
        assert body["policy_version"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(record["pid"], 0)  # the SGLang child did not outlive the launcher
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_launcher_says_why_sglang_did_not_start_in_one_line(
    tmp_path: Path, stand_in: dict[str, str]
) -> None:
    env = stand_in | {"FAKE_SGLANG_CRASH": "1"}
    proc = _launch(tmp_path, env, free_port(), stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    log = tmp_path / "rollout-sglang-s-test.log"
    assert proc.returncode == 1
    assert err.decode().strip().splitlines()[-1] == (
        "rollout: error: SGLang did not start: ImportError: [sgl_kernel] CRITICAL: Could not "
        f"load any common_ops library! (its whole output: {log})"
    )
