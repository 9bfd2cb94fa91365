"""Two steps of the sharded trainer under torchrun, one rank (run by test_sharded_nccl.py).

    python -m torch.distributed.run --standalone --nproc_per_node 1 \
        -m tests.gpu.sharded_nccl_steps MODEL_DIR OUT.json [cuda|cpu]

The sharded trainer's own pieces, without a broker: `init_ranks` (NCCL and `cuda:LOCAL_RANK`
on a GPU, gloo on the CPU), `build_policy` (FSDP2 over the decoder layers), and
`sharded_train_step` on two batches of `test_trainer_device.groups`. Rank 0 writes the
backend, the device, each step's metrics and how far the parameters moved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.gpu.test_trainer_device import groups
from workers.trainer.batching import collate_groups
from workers.trainer.config import TrainerConfig
from workers.trainer.sharded import build_policy, init_ranks
from workers.trainer.sharded_step import sharded_train_step
from workers.weights.checkpoint import TrainerState


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    config = TrainerConfig(model_dir=str(model_dir), device=device, micro_batch_size=2)
    ranks = init_ranks(config)
    policy = build_policy(config, model_dir, TrainerState(), ranks)

    def local(p: torch.Tensor) -> torch.Tensor:
        return (p.to_local() if hasattr(p, "to_local") else p).detach().float()

    before = [local(p).clone() for p in policy.model.parameters()]
    steps = []
    for seed in range(2):
        vocab = policy.model.config.vocab_size
        batch = collate_groups(groups(vocab, seed=seed), pad_token_id=policy.pad_token_id)
        metrics = sharded_train_step(
            policy.model,
            policy.optimizer,
            batch.to(ranks.device),
            config,
            rank=ranks.rank,
            world=ranks.world,
            group=ranks.control,  # as the trainer calls it: the step's CPU collectives there
            ref_model=policy.ref_model,
        )
        steps.append({k: float(metrics[k]) for k in ("loss", "grad_norm", "skipped_nonfinite")})
    moved = max(
        float((local(p) - b.to(local(p).device)).abs().max())
        for p, b in zip(policy.model.parameters(), before, strict=True)
    )
    if ranks.rank == 0:
        result = {
            "backend": dist.get_backend(),
            "device": str(ranks.device),
            "world": ranks.world,
            "steps": steps,
            "moved": moved,
        }
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
