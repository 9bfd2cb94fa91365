"""`trainer.device`: what the config accepts and what `resolve_device` makes of it."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from workers.trainer.config import TrainerConfig
from workers.trainer.exceptions import DeviceError
from workers.trainer.step import resolve_device


@pytest.mark.parametrize("name", ["cpu", "auto", "cuda", "cuda:0", "cuda:12"])
def test_the_config_takes_cpu_cuda_and_auto(name: str) -> None:
    assert TrainerConfig(device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "mps", " cpu"])
def test_the_config_refuses_other_devices(name: str) -> None:
    with pytest.raises(ValidationError, match="device"):
        TrainerConfig(device=name)


def test_cpu_and_auto() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want


def test_a_gpu_this_machine_lacks_is_a_clear_error() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DeviceError, match=f"cuda:{count}"):
        resolve_device(f"cuda:{count}")
    if count == 0:
        with pytest.raises(DeviceError, match="no CUDA device"):
            resolve_device("cuda")


def test_a_bf16_step_stays_close_to_the_fp32_step(tmp_path) -> None:
    """`trainer.precision=bf16` on the CPU: autocast forward/backward, fp32 weights and AdamW."""
    from transformers import AutoModelForCausalLM

    from pipeline.harness.models.tiny import init_model
    from schemas.events import ExtraFields, ScoredTrajectory
    from workers.trainer.batching import collate
    from workers.trainer.step import train_step

    path = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    samples = [
        ScoredTrajectory(
            uid="u",
            trajectory_id=f"u/{i}",
            sample_index=i,
            attempt_id="a",
            data_source="t",
            prompt_ids=[11, 12, 13, 14][: 2 + i],
            response_ids=[21 + i, 40, 41, 42, 43 - i],
            response_mask=[1, 1, 0, 1, 1],
            response_logprobs=[-2.0, -3.0, 0.0, -1.5, -2.5],
            num_turns=2,
            reward_score=float(i),
            extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
        )
        for i in range(3)
    ]
    batch = collate(samples, [1.0, -0.5, -0.5])
    metrics = {}
    for precision in ("fp32", "bf16"):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = TrainerConfig(precision=precision)
        metrics[precision] = train_step(model, optimizer, batch, config)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    fp32, bf16 = metrics["fp32"], metrics["bf16"]
    print({k: (fp32[k], bf16[k]) for k in ("loss", "grad_norm")})
    assert bf16["skipped_nonfinite"] == 0.0
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=5e-2, abs=1e-3)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-1)
    assert bf16["loss"] != fp32["loss"]  # autocast did run in bf16


def test_moe_step_with_r3_trains_through_the_recorded_experts_and_off_counts_the_mismatch() -> None:
    """Sequences that spanned two versions (the prompt and 3 response tokens routed by
    checkpoint A, the rest by B, as a resumed generation records them), trained at B: with
    `off` the step log's `router_mismatch_rate` is above 0; with `r3` every layer's experts
    (seen by hooks on them) are the recorded ones, the rate is 0, and every router's weights
    move (their gradient is not 0)."""
    import copy

    from tests.unit.workers.trainer.moe_helpers import (
        LAYERS,
        make_batch,
        moe_model,
        perturbed,
        routed,
        routers,
        sequences,
    )
    from workers.trainer.packing import layout
    from workers.trainer.router_replay import batch_routing
    from workers.trainer.step import train_step

    a = moe_model(0)
    b = perturbed(a)
    pairs = sequences()
    spanning = [routed(a, p + r, tokens=len(p) + 3).extended_by(routed(b, p + r)) for p, r in pairs]
    batch = make_batch(pairs, spanning)
    plain = make_batch(pairs, [None] * len(pairs))
    assert batch.routed_experts is not None and plain.routed_experts is None
    recorded = batch_routing(batch)
    assert recorded is not None
    recorded = recorded.long()
    metrics = {}
    for mode in ("off", "r3"):
        model = copy.deepcopy(b)
        before = [g.weight.detach().clone() for g in routers(model)]
        used: list[torch.Tensor] = []
        hooks = [
            layer.mlp.experts.register_forward_pre_hook(
                lambda m, args, used=used: used.append(args[1])
            )
            for layer in model.model.layers
        ]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = TrainerConfig(router_replay=mode, micro_batch_size=2, ppo_mini_batches=2)
        metrics[mode] = train_step(model, optimizer, batch, config)
        for h in hooks:
            h.remove()
        if mode == "r3":
            # The step's forwards: the proximal logprobs (two micro-batches), then one per
            # mini-batch (whole groups: samples 0-1, then 2-3), each packed: the recorded
            # routing packed like the tokens (`Layout.take`).
            assert len(used) == 4 * LAYERS
            for k, experts in enumerate(used):
                lo = 2 * ((k // LAYERS) % 2)
                view = layout(batch.select(lo, lo + 2))
                want = view.take(recorded[lo : lo + 2])[0, :, k % LAYERS]
                assert want.shape == experts.shape
                rows = (want >= 0).all(dim=-1)
                assert rows.sum() > 0
                assert torch.equal(experts[rows], want[rows])
            for g, w in zip(routers(model), before, strict=True):
                assert not torch.equal(g.weight, w)  # a nonzero gradient reached it
    off, r3 = metrics["off"], metrics["r3"]
    print({k: (off.get(k), r3.get(k)) for k in ("router_mismatch_rate", "router_rows")})
    assert off["router_mismatch_rate"] > 0
    assert "router_live_mismatch_rate" not in off
    assert r3["router_mismatch_rate"] == 0
    assert r3["router_live_mismatch_rate"] == pytest.approx(off["router_mismatch_rate"], abs=0.2)
    assert r3["router_rows"] == off["router_rows"] > 0
    # No routing in the batch: no routing figures.
    model = copy.deepcopy(b)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dense = train_step(model, optimizer, plain, TrainerConfig(router_replay="r3"))
    assert not any(k.startswith("router_") for k in dense)
