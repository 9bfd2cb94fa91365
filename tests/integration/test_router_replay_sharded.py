"""Routing replay in the FSDP2-sharded trainer: 2 gloo ranks (torchrun) train one r3 step of a
tiny Qwen3-MoE at checkpoint B on routing recorded at checkpoint A. Each rank's experts (seen by
hooks) are the recorded ones, the step's figures are the whole batch's, and the weights equal
those of the one-process r3 step on the same batch."""

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

MODULE = "tests.integration.test_router_replay_sharded"


def _config(tmp: Path) -> Any:
    from workers.trainer.config import TrainerConfig

    return TrainerConfig(
        router_replay="r3",
        micro_batch_size=1,
        lr=1e-3,
        torch_threads=1,
        checkpoint_dir=str(tmp / "none"),
    )


def _batch(a_dir: Path) -> Any:
    """The same batch on every process: 4 sequences, routing recorded by A's own forward."""
    from transformers import AutoModelForCausalLM

    from tests.unit.workers.trainer.moe_helpers import make_batch, routed, sequences

    a = AutoModelForCausalLM.from_pretrained(str(a_dir)).eval()
    pairs = sequences()
    return make_batch(pairs, [routed(a, p + r) for p, r in pairs])


def _rank_main(tmp: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.unit.workers.trainer.moe_helpers import LAYERS
    from workers.trainer.packing import layout
    from workers.trainer.router_replay import batch_routing
    from workers.trainer.sharded import build_policy, init_ranks
    from workers.trainer.sharded_step import shard_bounds, sharded_train_step
    from workers.weights.checkpoint import TrainerState

    torch.set_num_threads(1)
    config = _config(tmp)
    batch = _batch(tmp / "a")
    ranks = init_ranks(config)
    policy = build_policy(config, tmp / "b", TrainerState(), ranks)
    used: list[torch.Tensor] = []
    for layer in policy.model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: used.append(args[1]))
    metrics = sharded_train_step(
        policy.model,
        policy.optimizer,
        batch,
        config,
        rank=ranks.rank,
        world=ranks.world,
        group=ranks.control,
    )
    lo, hi = shard_bounds(len(batch), ranks.rank, ranks.world)
    recorded = batch_routing(batch).long()
    checked = 0
    assert len(used) == (hi - lo) * LAYERS  # one micro-batch (one sample) per forward
    for k, experts in enumerate(used):
        i = lo + k // LAYERS  # packed forwards: the routing packed like the tokens
        want = layout(batch.select(i, i + 1)).take(recorded[i : i + 1])[0, :, k % LAYERS]
        assert want.shape == experts.shape
        rows = (want >= 0).all(dim=-1)
        assert torch.equal(experts[rows], want[rows]), f"rank {ranks.rank} forward {k}"
        checked += int(rows.sum())
    full = get_model_state_dict(
        policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    figures = {k: v for k, v in metrics.items() if k.startswith("router_")}
    (tmp / f"rank{ranks.rank}.json").write_text(json.dumps({"checked": checked, **figures}))
    if ranks.rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / "n.safetensors"))
    dist.destroy_process_group()


def test_sharded_r3_step_replays_on_every_rank_and_equals_one_process(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from pipeline.launch.torchrun import torchrun_command
    from tests.unit.workers.trainer.moe_helpers import moe_model, perturbed
    from workers.trainer.step import train_step

    a = moe_model(0)
    b = perturbed(a)
    a.save_pretrained(str(tmp_path / "a"))
    b.save_pretrained(str(tmp_path / "b"))
    config = _config(tmp_path)
    optimizer = torch.optim.AdamW(
        b.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    one = train_step(b.train(), optimizer, _batch(tmp_path / "a"), config)

    cmd = torchrun_command(2, MODULE, [str(tmp_path)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["checked"] > 0 for r in ranks)
    for figures in ranks:
        assert figures["router_mismatch_rate"] == 0
        assert figures["router_rows"] == one["router_rows"]
        assert figures["router_live_mismatch_rate"] == pytest.approx(
            one["router_live_mismatch_rate"]
        )
    assert one["router_live_mismatch_rate"] > 0
    sharded = load_file(str(tmp_path / "n.safetensors"))
    state = b.state_dict()
    diff = max(float((state[k] - v).abs().max()) for k, v in sharded.items())
    print({"max_abs_param_diff": diff, "router_live_mismatch_rate": ranks[0]})
    assert diff < 1e-5


if __name__ == "__main__":  # one torchrun rank: `python -m tests.integration.… TMP_DIR`
    from workers.trainer.sharded import leave_rank

    _rank_main(Path(sys.argv[1]))
    leave_rank(0)
