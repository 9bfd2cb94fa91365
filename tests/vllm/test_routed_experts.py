"""The `moe` preset on vLLM's CPU build, and routed experts, which that build cannot return.

vLLM 0.32 returns routed experts only from its model runner V2 (`--enable-return-routed-
experts`, which `rollout replica serve --backend vllm --routed-experts` passes with
`VLLM_USE_V2_MODEL_RUNNER=1`). On the CPU build that runner needs Triton, which has no CPU
backend there, so the server refuses to start: the replica then fails in one line naming that
cause. If a later CPU build starts, the second test fails and says so: then this file should
compare the routing it returns with a transformers forward, as tests/gpu/test_routed_experts.py
does on a GPU (infra/gpu_check.sh).

What the CPU build does serve: the preset itself (Qwen3-MoE, fused-MoE CPU kernels), with the
logprobs of a transformers forward; a request asking that replica for routing gets 400.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.vllm.support import (
    FAST_START,
    REPO,
    VLLM_CPU_ENV,
    VLLM_PYTHON,
    Replica,
    http,
    reference_logprobs,
)

pytestmark = pytest.mark.vllm

PROMPT = [(13 * i + 7) % 900 + 20 for i in range(24)]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} missing: build it with `make vllm`", pytrace=False)
    from pipeline.harness.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("vllm-moe") / "moe", preset="moe", seed=0)


@pytest.fixture(scope="module")
def moe_replica(moe_model: Path, replica_logs: Path) -> Iterator[Replica]:
    log = replica_logs / "replica-moe.log"
    with Replica(moe_model, free_port(), log, max_model_len=2048) as replica:
        yield replica


def test_the_moe_preset_serves_on_the_cpu_build(moe_replica: Replica, moe_model: Path) -> None:
    body = moe_replica.complete(
        prompt=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0
    )
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 16 and choice["routed_experts"] is None
    want = reference_logprobs(moe_model, PROMPT, choice["token_ids"])
    got = choice["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3
    status, err = http(
        moe_replica.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2, "return_routed_experts": True},
    )
    assert status == 400 and "does not return routing" in err["error"]["message"], err


def test_routed_experts_need_model_runner_v2_which_the_cpu_build_lacks(
    moe_model: Path, replica_logs: Path
) -> None:
    argv = [
        sys.executable, "-m", "pipeline.cli.main",
        "replica", "serve",
        "--backend", "vllm",
        "--model", str(moe_model),
        "--port", str(free_port()),
        "--routed-experts",
        "--vllm-python", str(VLLM_PYTHON),
        "--max-model-len", "2048",
        "--dtype", "float32",
        *FAST_START,
    ]  # fmt: skip
    env = os.environ | VLLM_CPU_ENV | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    (replica_logs / "replica-moe-routed.err").write_text(done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("rollout: error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-2000:]
    assert "Model Runner V2 requires Triton" in errors[0], (
        f"vLLM's CPU build failed otherwise, or started: {errors[0]}; if it now returns "
        "routed experts, test them here against a transformers forward"
    )
