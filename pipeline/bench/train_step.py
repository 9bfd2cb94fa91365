"""`rollout bench train-step`: what a trust region costs per trainer step.

The same batch (the demo's shape: `groups` groups of `n` samples, prompts of ~30 tokens,
responses of `response_tokens`) is trained by `workers.trainer.step.train_step` with one
optimiser update per step and with `mini_batches` × `epochs` updates (the proximal policy's
extra no-grad forward included), on the tiny model, rounds interleaved so a slow spell hits
both sides alike. Each side starts every round from the same weights and optimiser state.

Figures: `step_s_one_update` and `step_s_mini_batches` (the median over rounds, and every
round's), `ratio` = mini-batches / one update, `updates` per step on each side.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run"]


def _batch(groups: int, n: int, response_tokens: int, seed: int) -> Any:
    import random

    from schemas.advantages import grpo_advantages
    from schemas.events import ExtraFields, ScoredTrajectory
    from workers.trainer.batching import collate

    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(10, 1000) for _ in range(28 + g % 5)]
        for i in range(n):
            length = rng.randint(response_tokens // 2, response_tokens)
            samples.append(
                ScoredTrajectory(
                    uid=f"u{g}",
                    trajectory_id=f"u{g}/{i}",
                    sample_index=i,
                    attempt_id="a",
                    data_source="bench",
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(10, 1000) for _ in range(length)],
                    response_mask=[1] * length,
                    response_logprobs=[-2.0] * length,
                    num_turns=2,
                    reward_score=float(rng.random() < 0.5),
                    extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
                )
            )
    adv = grpo_advantages([s.reward_score for s in samples], [s.uid for s in samples])
    return collate(samples, adv)


def run(
    *,
    groups: int = 8,
    n: int = 8,
    response_tokens: int = 8,
    mini_batches: int = 2,
    epochs: int = 1,
    rounds: int = 7,
    threads: int = 1,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from workers.llm.model_init import init_model
    from workers.trainer.config import TrainerConfig
    from workers.trainer.step import train_step

    torch.set_num_threads(threads)
    batch = _batch(groups, n, response_tokens, seed=0)
    sides = {
        "one_update": TrainerConfig(micro_batch_size=groups * n, lr=1e-4),
        "mini_batches": TrainerConfig(
            micro_batch_size=groups * n, lr=1e-4, ppo_mini_batches=mini_batches, ppo_epochs=epochs
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    updates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rollout-bench-step-") as tmp:
        path = init_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        for round_ in range(rounds + 1):  # round 0 warms both up and is not counted
            for name, config in sides.items():
                model = copy.deepcopy(base)
                optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
                started = time.perf_counter()
                metrics = train_step(model, optimizer, batch, config)
                elapsed = time.perf_counter() - started
                updates[name] = float(metrics["optimizer_updates"])
                if round_:
                    times[name].append(elapsed)
    one, many = (statistics.median(times[k]) for k in ("one_update", "mini_batches"))
    return {
        "benchmark": "train-step",
        "samples": len(batch),
        "response_tokens": response_tokens,
        "updates_one_update": updates["one_update"],
        "updates_mini_batches": updates["mini_batches"],
        "step_s_one_update": one,
        "step_s_mini_batches": many,
        "ratio": many / one,
        "rounds_one_update": [round(t, 4) for t in times["one_update"]],
        "rounds_mini_batches": [round(t, 4) for t in times["mini_batches"]],
        "threads": threads,
    }
