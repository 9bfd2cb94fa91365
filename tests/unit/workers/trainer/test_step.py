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

    from schemas.events import ExtraFields, ScoredTrajectory
    from workers.llm.model_init import init_model
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
