"""The sharded trainer on a GPU: FSDP2 under torchrun with one rank on NCCL, two steps
(infra/gpu_check.sh, step 1c). One GPU is enough for one rank; what it proves is that the
sharded step's collectives run on NCCL with CUDA tensors (a CPU tensor in a collective, which
gloo accepts, fails here), that both steps are finite and that the weights move.

Skipped without CUDA. Runs `tests/gpu/sharded_nccl_steps.py` under `torch.distributed.run`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.harness.models.tiny import init_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
REPO = Path(__file__).resolve().parents[2]


def run_steps(tmp_path: Path, device: str) -> dict:
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    out = tmp_path / "steps.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    argv += ["1", "-m", "tests.gpu.sharded_nccl_steps", str(model), str(out), device]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(argv, env=env, cwd=REPO, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def test_the_sharded_trainer_steps_twice_on_one_nccl_rank(tmp_path: Path) -> None:
    result = run_steps(tmp_path, "cuda")
    print("sharded trainer under torchrun:", result)
    assert result["backend"] == "nccl" and result["device"] == "cuda:0" and result["world"] == 1
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        assert step["skipped_nonfinite"] == 0.0 and math.isfinite(step["loss"])
    assert result["moved"] > 0
