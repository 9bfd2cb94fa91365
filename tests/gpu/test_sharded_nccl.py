"""The sharded trainer on NCCL (issue 42): one torchrun rank on one GPU (`trainer.device=cuda`,
so the default process group is NCCL) trains two steps of packed micro-batches by a token
budget. Before the fix the step all-reduced a CPU tensor on the default group and failed right
after the first optimiser step (`No backend type associated with device type cpu`). Run by
infra/gpu_check.sh; skipped without CUDA."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

MODULE = "tests.gpu.test_sharded_nccl"
REPO = Path(__file__).resolve().parents[2]


def _rank_main(tmp: Path) -> None:
    import torch.distributed as dist

    from tests.unit.workers.trainer.test_packing import ragged_batch
    from workers.trainer.checkpoint import TrainerState
    from workers.trainer.config import TrainerConfig
    from workers.trainer.sharded import build_policy, init_ranks
    from workers.trainer.sharded_step import sharded_train_step

    config = TrainerConfig(
        device="cuda",
        precision="bf16",
        max_tokens_per_micro_batch=128,
        checkpoint_dir=str(tmp / "none"),
    )
    ranks = init_ranks(config)
    assert dist.get_backend() == "nccl"
    policy = build_policy(config, tmp / "model", TrainerState(), ranks)
    steps = []
    for seed in (0, 1):
        batch = ragged_batch(seed=seed).to(ranks.device)
        metrics = sharded_train_step(
            policy.model,
            policy.optimizer,
            batch,
            config,
            rank=ranks.rank,
            world=ranks.world,
            group=ranks.control,
        )
        steps.append({k: metrics[k] for k in ("loss", "grad_norm", "skipped_nonfinite", "tokens")})
    (tmp / "steps.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


def test_one_nccl_rank_trains_two_steps(tmp_path: Path) -> None:
    from pipeline.launch.torchrun import torchrun_command
    from tests.unit.workers.trainer.test_packing import _model

    _model().save_pretrained(str(tmp_path / "model"))
    done = subprocess.run(
        torchrun_command(1, MODULE, [str(tmp_path)]),
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((tmp_path / "steps.json").read_text())
    print(steps)
    assert len(steps) == 2
    for step in steps:
        assert step["skipped_nonfinite"] == 0 and step["tokens"] > 0
        assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])


if __name__ == "__main__":  # one torchrun rank: `python -m tests.gpu.test_sharded_nccl TMP_DIR`
    from workers.trainer.sharded import leave_rank

    _rank_main(Path(sys.argv[1]))
    leave_rank(0)
