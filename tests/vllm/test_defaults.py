"""`rollout replica serve --backend vllm --model DIR` with nothing else — no KV-cache variable,
no dtype, no vLLM flag, no interpreter (the checkout's .venv-vllm is found) — becomes healthy on
this CPU, says the dtype it serves in, and its logprobs are the fp32 trainer's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.vllm.support import REPO, http, reference_logprobs

pytestmark = pytest.mark.vllm

PROMPT = [(13 * i + 7) % 900 + 20 for i in range(24)]


def test_the_bare_command_serves_the_trainers_logprobs(checkpoints, tmp_path) -> None:
    model = checkpoints["tied"][0]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    log = tmp_path / "replica.log"
    cmd = [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--backend", "vllm"]
    # --port only so the test cannot collide with anything on 8000 (the default).
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--model", str(model), "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if http(url + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(2.0)
        said = log.read_text()
        assert "rollout: vLLM serves in float32 (trainer.precision=fp32" in said
        assert "Traceback" not in said
        status, body = http(
            url + "/v1/completions",
            {
                "prompt": PROMPT,
                "max_tokens": 16,
                "ignore_eos": True,
                "logprobs": 0,
                "seed": 3,
                "temperature": 1.0,
            },
        )
        assert status == 200, body
        (choice,) = body["choices"]
        tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        expected = reference_logprobs(model, PROMPT, tokens)
        drift = max(abs(a - b) for a, b in zip(logprobs, expected, strict=True))
        assert drift <= 1e-4, drift
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
