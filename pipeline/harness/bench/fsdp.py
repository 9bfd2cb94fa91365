"""`rollout bench fsdp`: one trainer step in one process vs the same step over N gloo ranks.

The same batch (`pipeline.harness.bench.train_step`'s demo-shaped batch, grad accumulation over
micro-batches, clipping on) from the same tiny-model weights: once by the one-process
`train_step` in this process, once by `sharded_train_step` in N torchrun ranks (FSDP2, gloo on
cpu; this command starts them). Each rank computes the batch itself from the same seed.

Figures: `ranks`; `max_abs_param_diff` between the two sets of weights after the step (fp32;
the acceptance bound is 1e-5) next to `max_abs_update`, how far the step moved any weight, so
the diff is seen against a step that did something. AdamW's first update is close to
`lr · sign(g)`, so a first step hides small gradient differences; `max_abs_param_diff_step2`
is the diff after a second step on a second batch, where the moments make the update depend
on the gradients' values. `loss_1`/`loss_n` (and `_step2`); `step_s_1`/`step_s_n`
(one step, wall time; on 2 shared cores the sharded step is slower: the bench is about
equality, not speed) and their `ratio` n/1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run"]

GROUPS, N, RESPONSE_TOKENS, MICRO, LR = 4, 4, 8, 4, 1e-3


def _config() -> Any:
    from workers.trainer.config import TrainerConfig

    return TrainerConfig(micro_batch_size=MICRO, lr=LR, torch_threads=1)


def _rank_main(model_dir: str, out: str) -> None:
    """One torchrun rank: the sharded step, then rank 0 writes the full weights and figures."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from pipeline.harness.bench.train_step import _batch
    from workers.trainer.sharded import build_policy, init_ranks, train_policy
    from workers.weights.checkpoint import TrainerState

    torch.set_num_threads(1)
    config = _config().model_copy(update={"checkpoint_dir": str(Path(out) / "none")})
    ranks = init_ranks(config)
    policy = build_policy(config, Path(model_dir), TrainerState(), ranks)
    result: dict[str, Any] = {"ranks": ranks.world}
    for step in (1, 2):
        batch = _batch(GROUPS, N, RESPONSE_TOKENS, seed=step - 1)
        dist.barrier()
        started = time.perf_counter()
        metrics = train_policy(policy, batch, config, ranks)
        result[f"step_s_{step}"] = time.perf_counter() - started
        result[f"loss_{step}"] = metrics["loss"]
        full = get_model_state_dict(
            policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if ranks.rank == 0:
            tensors = {k: v.contiguous() for k, v in full.items()}
            save_file(tensors, str(Path(out) / f"n-{step}.safetensors"))
    if ranks.rank == 0:
        (Path(out) / "n.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(*, ranks: int = 2, timeout_s: float = 300.0) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.harness.bench.train_step import _batch
    from pipeline.harness.models.tiny import init_model
    from pipeline.launch.torchrun import torchrun_command
    from workers.trainer.step import train_step

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rollout-bench-fsdp-") as tmp:
        model_dir = str(init_model(Path(tmp) / "tiny", preset="tiny", seed=0))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        config = _config()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        one, losses, times = [], [], []
        for seed in (0, 1):
            batch = _batch(GROUPS, N, RESPONSE_TOKENS, seed=seed)
            started = time.perf_counter()
            metrics = train_step(model, optimizer, batch, config)
            times.append(time.perf_counter() - started)
            losses.append(float(metrics["loss"]))
            one.append({k: v.detach().clone() for k, v in model.state_dict().items()})

        cmd = torchrun_command(ranks, "pipeline.harness.bench.fsdp", [model_dir, tmp])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the {ranks} ranks failed:\n{done.stderr[-3000:]}")
        sharded = [load_file(str(Path(tmp) / f"n-{step}.safetensors")) for step in (1, 2)]
        figures = json.loads((Path(tmp) / "n.json").read_text())

    def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    diff, diff_2 = max_diff(one[0], sharded[0]), max_diff(one[1], sharded[1])
    update = max_diff(one[0], {k: before[k] for k in sharded[0]})
    return {
        "benchmark": "fsdp",
        "ranks": figures["ranks"],
        "samples": len(batch),
        "micro_batch_size": MICRO,
        "lr": LR,
        "max_abs_param_diff": diff,
        "max_abs_update": update,
        "max_abs_param_diff_step2": diff_2,
        "loss_1": losses[0],
        "loss_n": figures["loss_1"],
        "step_s_1": times[0],
        "step_s_n": figures["step_s_1"],
        "ratio": figures["step_s_1"] / times[0],
        "loss_1_step2": losses[1],
        "loss_n_step2": figures["loss_2"],
        "dtype": "fp32",
    }


# One torchrun rank: `python -m pipeline.harness.bench.fsdp MODEL_DIR OUT_DIR`.
if __name__ == "__main__":
    from workers.trainer.sharded import leave_rank

    _rank_main(sys.argv[1], sys.argv[2])
    leave_rank(0)
