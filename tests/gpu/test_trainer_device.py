"""The trainer on a GPU (`trainer.device=cuda`): run by infra/gpu_check.sh, skipped without CUDA.

- One PPO step on the GPU gives the CPU step's loss, metrics and gradient norm; under bf16
  autocast (`trainer.precision=bf16`) it stays close to them, with fp32 weights.
- `Trainer._load` puts the policy and AdamW on the configured device; a checkpoint written
  from the GPU (weights + optimizer) resumes on the CPU with the very same tensors.

Needs torch, transformers, safetensors, pydantic, kafka-python (imported by the trainer
module, no broker is used) and this checkout on PYTHONPATH.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pipeline.harness.models.tiny import init_model
from schemas.events import ExtraFields, ScoredTrajectory, TrainingGroup
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.trainer.batching import collate_groups
from workers.trainer.config import TrainerConfig
from workers.trainer.step import resolve_device, train_step
from workers.trainer.trainer import Trainer
from workers.weights.checkpoint import TrainerState, save_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


def groups(vocab: int, seed: int = 0) -> list[TrainingGroup]:
    """Two groups of 3 samples with ragged prompts/responses and tool tokens masked out."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(5, 12))]
        samples = []
        for i in range(3):
            n = rng.randint(4, 20)
            samples.append(
                ScoredTrajectory(
                    uid=f"g{g}",
                    trajectory_id=f"g{g}/{i}",
                    sample_index=i,
                    attempt_id="a",
                    data_source="test",
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(10, vocab) for _ in range(n)],
                    response_mask=[0 if 3 <= j < 5 else 1 for j in range(n)],
                    response_logprobs=[-rng.uniform(0.5, 6.0) for _ in range(n)],
                    num_turns=2,
                    reward_score=float(i == g),
                    extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
                )
            )
        out.append(
            TrainingGroup(
                uid=f"g{g}",
                samples=samples,
                advantages=[1.0, -0.5, -0.5],
                min_global_steps=0,
                max_global_steps=0,
                emitted_at_version=0,
            )
        )
    return out


def load(model_dir: Path, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.to(device)


def test_a_step_on_the_gpu_matches_the_cpu(model_dir: Path) -> None:
    config = TrainerConfig(micro_batch_size=2, entropy_coeff=0.01)
    metrics = {}
    for device in ("cpu", "cuda"):
        model = load(model_dir, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = collate_groups(groups(model.config.vocab_size)).to(device)
        assert batch["input_ids"].device.type == device
        metrics[device] = train_step(model, optimizer, batch, config)
        assert next(model.parameters()).device.type == device
    cpu, gpu = metrics["cpu"], metrics["cuda"]
    print({k: (cpu[k], gpu[k]) for k in ("loss", "grad_norm", "entropy", "is_weight_mean")})
    assert gpu["skipped_nonfinite"] == 0.0
    for key in ("loss", "grad_norm", "entropy", "is_weight_mean", "pg_clipfrac"):
        assert gpu[key] == pytest.approx(cpu[key], rel=2e-3, abs=1e-5), key


def test_a_bf16_step_on_the_gpu_stays_close_to_fp32(model_dir: Path) -> None:
    metrics = {}
    for precision in ("fp32", "bf16"):
        model = load(model_dir, "cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = collate_groups(groups(model.config.vocab_size)).to("cuda")
        config = TrainerConfig(micro_batch_size=2, precision=precision)
        metrics[precision] = train_step(model, optimizer, batch, config)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    fp32, bf16 = metrics["fp32"], metrics["bf16"]
    print({k: (fp32[k], bf16[k]) for k in ("loss", "grad_norm", "entropy")})
    assert bf16["skipped_nonfinite"] == 0.0 and bf16["loss"] != fp32["loss"]
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=5e-2, abs=1e-3)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-1)


def test_the_trainer_loads_on_the_gpu_and_its_checkpoint_resumes_on_the_cpu(
    model_dir: Path, tmp_path: Path
) -> None:
    assert resolve_device("auto").type == "cuda"
    root = tmp_path / "ckpt"
    config = TrainerConfig(model_dir=str(model_dir), checkpoint_dir=str(root), device="cuda")
    trainer = Trainer(KafkaConfig(), TopicsConfig(), config)
    trainer._load()  # no broker: only the model, the optimizer and the device
    assert trainer.device.type == "cuda"
    assert {p.device.type for p in trainer.model.parameters()} == {"cuda"}
    batch = collate_groups(groups(trainer.model.config.vocab_size)).to(trainer.device)
    train_step(trainer.model, trainer.optimizer, batch, config)
    states = [s for s in trainer.optimizer.state.values() if s]
    assert states and all(t.device.type == "cuda" for s in states for t in s.values() if t.dim())
    save_checkpoint(
        root,
        TrainerState(version=1),
        trainer.model,
        tokenizer_from=model_dir,
        optimizer=trainer.optimizer,
    )

    resumed = Trainer(KafkaConfig(), TopicsConfig(), config.model_copy(update={"device": "cpu"}))
    resumed._load()
    assert resumed.state.version == 1 and resumed.device.type == "cpu"
    for (name, a), (_, b) in zip(
        trainer.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert b.device.type == "cpu"
        assert torch.equal(a.detach().cpu(), b), name
    gpu_state = trainer.optimizer.state_dict()["state"]
    cpu_state = resumed.optimizer.state_dict()["state"]
    assert gpu_state.keys() == cpu_state.keys()
    for index, slots in gpu_state.items():
        for name, value in slots.items():
            assert cpu_state[index][name].device.type == "cpu"
            assert torch.equal(value.cpu(), cpu_state[index][name]), (index, name)
