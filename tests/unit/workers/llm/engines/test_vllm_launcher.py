"""`rollout replica serve --backend vllm` end to end on CPU, with a stand-in `vllm` package.

The stand-in is written into a temporary directory put first on PYTHONPATH: its
`vllm.entrypoints.cli.main` answers the few endpoints the launcher needs, records its argv,
environment and pid, and exits on SIGTERM. This checks the process model (adapter first,
child in its own process group, health wait, clean stop on SIGTERM, exit when the child dies)
without vLLM or a GPU.
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
from workers.ports import free_port

FAKE_MAIN = """
import json, os, sys
from aiohttp import web

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
record = {"argv": args, "pid": os.getpid(), "dev": os.environ.get("VLLM_SERVER_DEV_MODE")}
with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
    json.dump(record, f)
if os.environ.get("FAKE_VLLM_CRASH"):
    print("(EngineCore_DP0 pid=7) ERROR 12-02 04:17:27 [core.py:700] Traceback (most recent")
    print("(EngineCore_DP0 pid=7) ERROR 12-02 04:17:27 [core.py:700] ValueError: no room for"
          " the KV cache", file=sys.stderr)
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: Engine core initialization failed. See root cause above.",
          file=sys.stderr)
    sys.exit(3)

async def health(_r):
    return web.json_response({})

async def models(_r):
    return web.json_response({"data": [{"id": "tiny", "max_model_len": 512}]})

async def completions(r):
    body = await r.json()
    n = body["max_tokens"]
    choice = {"index": 0, "text": "", "token_ids": list(range(n)), "finish_reason": "length",
              "stop_reason": None, "logprobs": {"token_logprobs": [-0.25] * n}}
    return web.json_response({"id": "cmpl-1", "created": 1, "model": "tiny",
                              "choices": [choice], "usage": {}})

app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", completions)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(FAKE_MAIN)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # a model directory, no tokenizer
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(ROOT)])
    env["FAKE_VLLM_RECORD"] = str(tmp_path / "record.json")
    return env


def _launch(
    tmp_path: Path, env: dict[str, str], port: int, **popen: Any
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--backend", "vllm"]
    cmd += ["--model", str(tmp_path / "model"), "--vllm-python", sys.executable]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--tp", "2", "--replica-id", "r-test"]
    cmd += ["--vllm-arg=--max-num-seqs", "--vllm-arg=8"]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, **popen)


@pytest.mark.slow
def test_launcher_serves_the_contract_and_stops_its_child(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    port = free_port()
    proc = _launch(tmp_path, fake_vllm, port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, lambda: proc.poll() is None, 60, name="the launcher")
        status, body = http(url + "/health", timeout=5)
        # no capacity: this fake vLLM has no /server_info to read max_num_seqs from; two
        # receivers of broadcast weights: its tp=2 workers
        assert (status, body) == (
            200,
            {
                "status": "ok",
                "version": 0,
                "load": 0,
                "receivers": 2,
                "transfer_backends": ["gloo", "nccl"],  # its workers receive
                "dtype": "float32",  # the dtype it serves: broadcast weights travel in it
            },
        )
        record = json.loads((tmp_path / "record.json").read_text())
        argv = record["argv"]
        assert argv[:2] == ["serve", str(tmp_path / "model")]
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert "--enable-prefix-caching" in argv and argv[-2:] == ["--max-num-seqs", "8"]
        assert "--skip-tokenizer-init" in argv  # the model directory has no tokenizer
        assert record["dev"] == "1"
        status, body = http(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 3}, timeout=5)
        assert status == 200 and body["choices"][0]["token_ids"] == [0, 1, 2]
        status, info = http(url + "/info", timeout=5)
        assert info["replica_id"] == "r-test" and info["max_model_len"] == 512
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        assert not _alive(record["pid"]), "the vLLM child outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_launcher_exits_when_vllm_fails_to_start(tmp_path: Path, fake_vllm: dict[str, str]) -> None:
    env = fake_vllm | {"FAKE_VLLM_CRASH": "1", "TMPDIR": str(tmp_path)}
    proc = _launch(tmp_path, env, free_port(), stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1
        said = err.decode().strip().splitlines()
        assert "Traceback" not in err.decode()  # vLLM's output is in its file, not here
        log = tmp_path / "rollout-vllm-r-test.log"
        assert said[-1] == (
            "rollout: error: vLLM did not start: ValueError: no room for the KV cache "
            f"(its whole output: {log})"
        )
        assert "Engine core initialization failed" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
