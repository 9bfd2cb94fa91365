"""`rollout bench train-step`: what the trainer's step makes of a device, against the same model
doing bare forward+backward passes of the same tokens.

The model is random weights built from a config (no hub download): `--geometry tiny` (the
`tiny` preset's shape, 1,024-token vocabulary) or `qwen2-0.5b` (Qwen2-0.5B's: 24 layers, hidden
896, 151,936-token vocabulary, 494 M parameters), fp32 master weights, bf16 autocast on a GPU.
The batch (`--batch`): `rl`, RL-shaped lengths (16 groups × 8 samples, prompts 64-256 tokens,
responses 16-1,024, on a GPU; 8 × 8, prompts 16-64, responses 4-256 on a CPU, so a run takes
a minute), or `uniform` (every sequence 256 + 768 tokens; 32 + 96 on a CPU).

Sides, interleaved round by round (one warm-up round, then `--rounds`), each from the same
initial weights, each step ending with one AdamW step:
- `project`: `workers.trainer.step.train_step` (packed micro-batches by a token budget,
  chunked logprobs, the PPO loss), one update;
- `project_padded`: the same step in the padded layout with full logits (`trainer.packed
  false`, `logprob_chunk_tokens null`: the trainer before issue 42), with `--padded-step 1`;
- `bare_padded`: micro-batches of `--micro-batch-size` samples padded as the project pads
  (verl's layout, the batch's width), cross-entropy over every position from fp32 logits;
- `bare_packed`: the same token-budget micro-batches as `project`, packed, through the same
  exact attention (`workers.trainer.attention`), cross-entropy over every position.

Figures: real (unpadded) tokens per second of each side (from its fastest step: on a shared
machine interference only adds time; every step's time is listed, and the median's rate),
`ratio_to_packed` = project / bare packed, `ratio_to_padded` = project / bare padded,
`padded_to_packed` = bare padded / bare packed, `padded_step_to_packed` (the old layout's
ratio): each the median over rounds of the two sides' speed ratio within the round (the
sides run seconds apart, so a slow spell weighs on both; `ratio_to_packed_fastest` is the ratio
of the fastest steps instead), MFU on real tokens (6 · parameters · tokens / time / the device's
dense bf16 peak: 989 TFLOP/s for an H100 or H200, 0 on a CPU or an unknown GPU), and each
side's peak memory (GPU: allocated by torch; CPU: the process's resident high-water mark
during that side's steps). `--profile 1` adds the top operators of one project step
(torch.profiler, self time).
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from contextlib import nullcontext
from typing import Any

__all__ = ["run"]

GEOMETRIES: dict[str, dict[str, int]] = {
    "tiny": {
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    "qwen2-0.5b": {
        "vocab_size": 151_936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
}
# (groups, samples per group, prompt lengths, response lengths) per batch kind and device kind.
SHAPES: dict[tuple[str, str], tuple[int, int, tuple[int, int], tuple[int, int]]] = {
    ("rl", "cuda"): (16, 8, (64, 256), (16, 1024)),
    ("uniform", "cuda"): (16, 8, (256, 256), (768, 768)),
    ("rl", "cpu"): (8, 8, (16, 64), (4, 256)),
    ("uniform", "cpu"): (8, 8, (32, 32), (96, 96)),
}
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16


def _batch(groups: int, n: int, response_tokens: int, seed: int) -> Any:
    """The demo-shaped batch `rollout bench fsdp` trains: prompts of ~30 tokens, responses of
    `response_tokens` // 2 to `response_tokens`, behaviour logprobs -2."""
    from schemas.advantages import grpo_advantages
    from workers.trainer.batching import collate

    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(10, 1000) for _ in range(28 + g % 5)]
        for i in range(n):
            length = rng.randint(response_tokens // 2, response_tokens)
            response = [rng.randrange(10, 1000) for _ in range(length)]
            samples.append(_sample(g, i, prompt, response, [-2.0] * length, rng))
    adv = grpo_advantages([s.reward_score for s in samples], [s.uid for s in samples])
    return collate(samples, adv)


def _sample(
    group: int,
    index: int,
    prompt: list[int],
    response: list[int],
    logprobs: list[float],
    rng: random.Random,
) -> Any:
    """One sample of group `group`, its reward a coin flip."""
    from schemas.events import ExtraFields, ScoredTrajectory

    return ScoredTrajectory(
        uid=f"u{group}",
        trajectory_id=f"u{group}/{index}",
        sample_index=index,
        attempt_id="a",
        data_source="bench",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=[1] * len(response),
        response_logprobs=logprobs,
        num_turns=2,
        reward_score=float(rng.random() < 0.5),
        extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
    )


def _make_batch(
    groups: int,
    n: int,
    prompts: tuple[int, int],
    responses: tuple[int, int],
    vocab: int,
    seed: int,
) -> Any:
    from schemas.advantages import grpo_advantages
    from workers.trainer.batching import collate

    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(*prompts))]
        for i in range(n):
            length = rng.randint(*responses)
            response = [rng.randrange(10, vocab) for _ in range(length)]
            logprobs = [-rng.uniform(0.5, 6.0) for _ in range(length)]
            samples.append(_sample(g, i, prompt, response, logprobs, rng))
    adv = grpo_advantages([s.reward_score for s in samples], [s.uid for s in samples])
    return collate(samples, adv)


class _Memory:
    """Peak memory of what runs between `reset` and `peak`: torch's allocations on a GPU, the
    process's resident high-water mark on a CPU (Linux: /proc/self/clear_refs resets it)."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def peak(self) -> float:
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**30
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 2**20
        except OSError:
            pass
        return 0.0


def _bare_step(model: Any, optimizer: Any, rows: list[dict[str, Any]], packed: bool) -> None:
    """Forward+backward of every row (cross-entropy at every real position), one AdamW step."""
    import torch

    from workers.trainer.attention import packed_attention

    for row in rows:
        ids = row["input_ids"]
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=ids.device.type == "cuda"):
            with packed_attention(model) if packed else nullcontext():
                logits = model(use_cache=False, **row).logits
        targets = ids[:, 1:].clone()
        if "attention_mask" in row:  # no target on padding
            targets = targets.masked_fill(row["attention_mask"][:, 1:] == 0, -100)
        if packed:  # no target across a boundary: the next sequence's first token
            starts = row["cu_seq_lens_q"][1:-1].long() - 1
            targets[0, starts] = -100
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        loss.backward()
        del logits, loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rows(batch: Any, config: Any, packed: bool) -> list[dict[str, Any]]:
    """The bare sides' forward inputs: the project's token-budget micro-batches, packed; or
    micro-batches of `micro_batch_size` samples with the batch's padding."""
    from workers.trainer.packing import layout
    from workers.trainer.step import micro_batches_of

    if not packed:
        size = config.micro_batch_size
        return [
            {
                "input_ids": mb["input_ids"],
                "attention_mask": mb["attention_mask"],
                "position_ids": mb["position_ids"],
            }
            for mb in batch.split(size)
        ]
    out = []
    for mb in micro_batches_of(batch, config):
        view = layout(mb)
        out.append({"input_ids": view.input_ids, **view.forward_kwargs()})
    return out


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _profile(model: Any, optimizer: Any, batch: Any, config: Any, top: int = 12) -> list[str]:
    """The `top` operators of one project step by self CPU time (and CUDA time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    from workers.trainer.step import train_step

    activities = [ProfilerActivity.CPU]
    if batch["input_ids"].device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        train_step(model, optimizer, batch, config)
    key = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    return [line for line in table.splitlines() if line.strip()]


def run(
    *,
    device: str = "auto",
    geometry: str = "tiny",
    batch: str = "rl",
    rounds: int = 7,
    threads: int = 1,
    micro_batch_size: int = 8,
    max_tokens: int = 0,
    padded_step: int = 1,
    profile: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from workers.trainer.attention import attention_path
    from workers.trainer.config import TrainerConfig
    from workers.trainer.micro_batches import sample_tokens
    from workers.trainer.step import micro_batches_of, resolve_device, train_step

    if geometry not in GEOMETRIES or batch not in ("rl", "uniform"):
        raise ValueError(f"--geometry {sorted(GEOMETRIES)}, --batch rl|uniform")
    torch.set_num_threads(threads)
    dev = resolve_device(device)
    groups, n, prompts, responses = SHAPES[(batch, "cuda" if dev.type == "cuda" else "cpu")]
    shape = GEOMETRIES[geometry]
    data = _make_batch(groups, n, prompts, responses, shape["vocab_size"], seed).to(dev)
    lengths = sample_tokens(data)
    real = sum(lengths)
    budget = max_tokens or max(max(lengths), -(-real * micro_batch_size // len(lengths)))
    precision = "bf16" if dev.type == "cuda" else "fp32"
    configs = {
        "project": TrainerConfig(
            micro_batch_size=micro_batch_size,
            max_tokens_per_micro_batch=budget,
            precision=precision,
        ),
    }
    if padded_step:
        configs["project_padded"] = configs["project"].model_copy(
            update={
                "packed": False,
                "logprob_chunk_tokens": None,
                "max_tokens_per_micro_batch": None,
            }
        )
    torch.manual_seed(seed)
    base = Qwen2ForCausalLM(
        Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)
    ).to(dev)
    params = sum(p.numel() for p in base.parameters())
    rows = {
        "bare_padded": _rows(data, configs["project"], packed=False),
        "bare_packed": _rows(data, configs["project"], packed=True),
    }
    # project beside bare_packed (their ratio is the headline), the padded pair after them
    sides = [
        s
        for s in ("project", "bare_packed", "project_padded", "bare_padded")
        if s in {**configs, **rows}
    ]
    models = {name: copy.deepcopy(base).train() for name in sides}
    optimizers = {name: torch.optim.AdamW(models[name].parameters(), lr=1e-6) for name in sides}
    times: dict[str, list[float]] = {name: [] for name in sides}
    peaks: dict[str, float] = dict.fromkeys(sides, 0.0)
    memory = _Memory(dev)
    for round_ in range(rounds + 1):  # round 0 warms up (and compiles, where anything does)
        order = sides if round_ % 2 == 0 else sides[::-1]
        for name in order:
            memory.reset()
            _synchronize(dev)
            started = time.perf_counter()
            if name in configs:
                train_step(models[name], optimizers[name], data, configs[name])
            else:
                _bare_step(models[name], optimizers[name], rows[name], name == "bare_packed")
            _synchronize(dev)
            if round_:
                times[name].append(time.perf_counter() - started)
            peaks[name] = max(peaks[name], memory.peak())
    name_of = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in name_of), 0.0)
    # The fastest round: on a shared machine, interference only ever adds time.
    rate = {name: real / min(times[name]) for name in sides}
    padded_tokens = int(data["input_ids"].numel())
    out: dict[str, Any] = {
        "benchmark": "train-step",
        "device": name_of,
        "geometry": geometry,
        "batch": batch,
        "params": params,
        "samples": len(lengths),
        "real_tokens": real,
        "padded_tokens": padded_tokens,
        "pad_share": round(1 - real / padded_tokens, 3),
        "token_budget": budget,
        "micro_batches": len(micro_batches_of(data, configs["project"])),
        "attention": attention_path(dev, torch.bfloat16 if precision == "bf16" else torch.float32),
        "threads": threads,
    }
    for name in sides:
        out[f"{name}_tokens_s"] = round(rate[name], 1)
        out[f"{name}_median_tokens_s"] = round(real / statistics.median(times[name]), 1)
        out[f"{name}_step_s"] = [round(t, 4) for t in times[name]]
        out[f"{name}_peak_gib"] = round(peaks[name], 3)
        out[f"{name}_mfu"] = round(6 * params * rate[name] / peak_flops, 4) if peak_flops else 0.0

    def ratio(side: str, base: str) -> float:
        """Median over rounds of base's time / side's time in the same round (both ran
        within seconds of each other, so a slow spell of the machine weighs on both)."""
        pairs = zip(times[side], times[base], strict=True)
        return round(statistics.median(b / a for a, b in pairs), 3)

    out["ratio_to_packed"] = ratio("project", "bare_packed")
    out["ratio_to_padded"] = ratio("project", "bare_padded")
    out["padded_to_packed"] = ratio("bare_padded", "bare_packed")
    if padded_step:
        out["padded_step_to_packed"] = ratio("project_padded", "bare_packed")
    out["ratio_to_packed_fastest"] = round(rate["project"] / rate["bare_packed"], 3)
    out["mfu"] = out["project_mfu"]
    if profile:
        out["profile_top"] = _profile(
            models["project"], optimizers["project"], data, configs["project"]
        )
    return out
