"""The sharded trainer packed (issue 42): 2 gloo ranks (torchrun, FSDP2) train one step of a
ragged multi-turn batch (tool tokens masked) in packed micro-batches by a token budget, the
samples shared over the ranks by tokens; for every `loss_agg_mode` the weights after the step
equal those of the one-process step in the padded layout (the reference), and so does the loss.
Two updates of plain SGD (two mini-batches): a weight's move is its gradient times the rate, so
equal weights are equal gradients (AdamW's first update, about lr · sign(g), would hide them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow]

MODULE = "tests.integration.test_trainer_packed_sharded"
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _config(tmp: Path, mode: str, packed: bool) -> Any:
    from workers.trainer.config import TrainerConfig

    split: dict[str, Any] = (
        {"max_tokens_per_micro_batch": 40, "logprob_chunk_tokens": 8}
        if packed
        else {"packed": False, "logprob_chunk_tokens": None, "micro_batch_size": 3}
    )
    return TrainerConfig(
        loss_agg_mode=mode,
        lr=0.1,
        torch_threads=1,
        ppo_mini_batches=2,
        checkpoint_dir=str(tmp / "none"),
        **split,
    )


def _rank_main(tmp: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.unit.workers.trainer.test_packing import ragged_batch
    from workers.trainer.sharded import build_policy, init_ranks
    from workers.trainer.sharded_step import rank_micro_batches, sharded_train_step
    from workers.trainer.step import mini_batches
    from workers.weights.checkpoint import TrainerState

    torch.set_num_threads(1)
    batch = ragged_batch(groups=4)
    ranks = None
    for mode in MODES:
        config = _config(tmp, mode, packed=True)
        ranks = ranks or init_ranks(config)
        policy = build_policy(config, tmp / "model", TrainerState(), ranks)
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=config.lr)
        metrics = sharded_train_step(
            policy.model,
            optimizer,
            batch,
            config,
            rank=ranks.rank,
            world=ranks.world,
            group=ranks.control,
        )
        mb = mini_batches(batch, config.ppo_mini_batches)[0]
        share = rank_micro_batches(mb, config, ranks.rank, ranks.world)
        tokens = sum(int(m["attention_mask"].sum()) for m, w in share if w)
        full = get_model_state_dict(
            policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        out = {"loss": metrics["loss"], "tokens": tokens, "micro": len(share)}
        (tmp / f"{mode}-rank{ranks.rank}.json").write_text(json.dumps(out))
        if ranks.rank == 0:
            save_file(
                {k: v.contiguous() for k, v in full.items()}, str(tmp / f"{mode}.safetensors")
            )
    dist.destroy_process_group()


def test_two_ranks_packed_by_tokens_equal_one_process_padded(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from pipeline.launch.torchrun import torchrun_command
    from tests.unit.workers.trainer.test_packing import _model, ragged_batch
    from workers.trainer.step import train_step

    base = _model()
    base.save_pretrained(str(tmp_path / "model"))
    cmd = torchrun_command(2, MODULE, [str(tmp_path)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    batch = ragged_batch(groups=4)
    for mode in MODES:
        import copy

        model = copy.deepcopy(base)
        config = _config(tmp_path, mode, packed=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
        one = train_step(model, optimizer, batch, config)
        ranks = [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
        sharded = load_file(str(tmp_path / f"{mode}.safetensors"))
        state = model.state_dict()
        diff = max(float((state[k] - v).abs().max()) for k, v in sharded.items())
        moved = max(
            float((state[k] - v).abs().max()) for k, v in base.state_dict().items() if k in state
        )
        print({"mode": mode, "max_abs_param_diff": diff, "max_abs_update": moved, "ranks": ranks})
        assert diff < 1e-5 * moved  # gradients within 1e-5 relative
        assert ranks[0]["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert ranks[0]["micro"] == ranks[1]["micro"]  # equal forward counts
        assert abs(ranks[0]["tokens"] - ranks[1]["tokens"]) < 0.25 * ranks[0]["tokens"]


if __name__ == "__main__":  # one torchrun rank: `python -m tests.integration.… TMP_DIR`
    from workers.trainer.sharded import leave_rank

    _rank_main(Path(sys.argv[1]))
    leave_rank(0)
