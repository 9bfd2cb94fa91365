"""`rollout bench moe`: what routing replay (R3) of a Mixture-of-Experts policy costs and fixes.

On the `moe` preset (Qwen3-MoE, every layer 8 experts, top-2), in one run:

1. Checkpoints: A (the preset, or `--model`) and B = A after one trainer step (`lr`, a random
   GRPO batch): two consecutive policy versions.
2. A real `hf` replica (`rollout replica serve`) serves A. `sequences` generations
   (`ignore_eos`, `max_tokens`, `return_routed_experts`) run at once; when the replica has
   generated about half of their tokens, `/update_weights` loads B (its pause aborts them
   mid-way, as a real weight sync does), and each is resumed at B with its prompt + tokens so
   far, as the LLM client resumes: the first piece's routing (A's) is kept and the second
   piece's appended for the positions past it (`RoutedExperts.extended_by`).
3. The trainer at B recomputes the response logprobs of the sequences that spanned both
   versions (`workers.trainer.step`'s forward, fp32), with `router_replay` off and r3:
   `router_mismatch_rate_no_replay`/`_replay` (recorded response (token, layer) rows whose
   experts in the trainer's forward differ from the recorded ones; 0 with replay) and
   `logprob_max_abs_diff_no_replay`/`_replay` (|trainer − rollout| over the response tokens),
   also split by the version that sampled the token (`_old`: piece 1 at A, `_new`: piece 2
   at B) with their means.
4. `routing_bytes_per_token`: the routing's share of a real response on the wire (its base64
   string over its positions), next to `routing_bytes_per_token_raw` (layers × top_k, u1).
5. Decode rate of the hf engine with routing returned vs not
   (`pipeline.harness.bench.moe_decode.decode_rate`), `rounds` interleaved rounds:
   `decode_tokens_per_s_routed`/`_plain`, `decode_ratio` (the median of per-round ratios).

How to read the logprob figures: a piece-2 token was sampled by B after B re-read the whole
prefix (the update drops the prefix cache), so B's engine routed the piece-1 positions its own
way; replay routes them as A did (the recorded history). On old tokens replay removes the
routing flips between A's and B's routers and leaves the weight change; on new ones it adds the
difference between A's and B's routing of the prefix.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.harness.bench.common import paired_ratio
from pipeline.launch.local import StageProcess
from pipeline.launch.replicas import wait_healthy
from workers.ports import free_port

__all__ = ["run"]


@dataclass
class Spanned:
    """One generation resumed across the update: its pieces joined as the client joins them."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    old_tokens: int = 0  # sampled by A (piece 1)
    routing: Any = None  # RoutedExperts
    versions: tuple[int, int] = (0, 0)
    wire_bytes_per_token: float = 0.0


def _next_checkpoint(a_dir: Path, b_dir: Path, lr: float, seed: int) -> None:
    """B: a copy of A's directory with A's weights after one trainer step on a random batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from schemas.advantages import grpo_advantages
    from schemas.events import ExtraFields, ScoredTrajectory
    from workers.trainer.batching import collate
    from workers.trainer.config import TrainerConfig
    from workers.trainer.step import train_step

    shutil.copytree(a_dir, b_dir)
    model = AutoModelForCausalLM.from_pretrained(str(a_dir), dtype=torch.float32)
    rng = random.Random(seed)
    vocab = int(model.config.vocab_size)
    samples = []
    for i in range(8):
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        response = [rng.randrange(3, vocab) for _ in range(16)]
        samples.append(
            ScoredTrajectory(
                uid=f"b{i // 4}",
                trajectory_id=f"b{i // 4}/{i % 4}",
                sample_index=i % 4,
                attempt_id="a",
                data_source="bench",
                prompt_ids=prompt,
                response_ids=response,
                response_mask=[1] * len(response),
                response_logprobs=[-5.0] * len(response),
                num_turns=2,
                reward_score=float(rng.random() < 0.5),
                extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
            )
        )
    adv = grpo_advantages([s.reward_score for s in samples], [s.uid for s in samples])
    config = TrainerConfig(lr=lr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    train_step(model, optimizer, collate(samples, adv), config)
    model.save_pretrained(str(b_dir), safe_serialization=True)


def _generated(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("rollout_replica_generated_tokens_total"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _spanning(
    url: str, b_dir: Path, prompts: list[list[int]], max_tokens: int, seed: int
) -> list[Spanned]:
    """Generate at A, update to B half-way, resume at B (module docstring, step 2)."""
    import aiohttp

    from workers.llm.contract import CompletionResponse

    async def complete(
        http: aiohttp.ClientSession, prompt: list[int], budget: int, i: int
    ) -> CompletionResponse:
        body = {
            "prompt": prompt,
            "max_tokens": budget,
            "temperature": 1.0,
            "seed": seed + i,
            "ignore_eos": True,
            "request_id": f"moe-{i}-{len(prompt)}",
            "return_routed_experts": True,
        }
        async with http.post(url + "/v1/completions", json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"replica answered {resp.status}: {text[:500]}")
        return CompletionResponse.model_validate_json(text)

    before = await asyncio.to_thread(_generated, url)
    half = before + len(prompts) * max_tokens / 2
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        first = [
            asyncio.create_task(complete(http, p, max_tokens, i)) for i, p in enumerate(prompts)
        ]
        while await asyncio.to_thread(_generated, url) < half and not all(t.done() for t in first):
            await asyncio.sleep(0.05)
        async with http.post(
            url + "/update_weights", json={"path": str(b_dir), "version": 1}
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"update_weights: {resp.status} {await resp.text()}")
        pieces = [await t for t in first]
        out = []
        resumes = []
        for i, (prompt, resp1) in enumerate(zip(prompts, pieces, strict=True)):
            choice = resp1.choices[0]
            left = max_tokens - len(choice.token_ids)
            if choice.finish_reason != "abort" or not choice.token_ids or left <= 0:
                continue  # finished before the update, or never started: not spanning
            span = Spanned(
                prompt=prompt,
                tokens=list(choice.token_ids),
                logprobs=list((choice.logprobs or {}).get("token_logprobs", [])),
                old_tokens=len(choice.token_ids),
                routing=choice.routed_experts,
            )
            out.append(span)
            resumes.append(asyncio.create_task(complete(http, prompt + span.tokens, left, i)))
        for span, task in zip(out, resumes, strict=True):
            resp2 = await task
            choice = resp2.choices[0]
            span.tokens += choice.token_ids
            span.logprobs += (choice.logprobs or {}).get("token_logprobs", [])
            span.routing = span.routing.extended_by(choice.routed_experts)
            span.versions = (0, resp2.policy_version)
            routed = choice.routed_experts
            encoded = len(routed.model_dump_json(include={"experts"})) - len('{"experts":""}')
            span.wire_bytes_per_token = encoded / max(routed.tokens, 1)
    return out


def _trainer_figures(b_dir: Path, spans: list[Spanned]) -> dict[str, Any]:
    """The trainer at B on the spanning sequences, router_replay off and r3 (step 3)."""
    import torch
    from transformers import AutoModelForCausalLM

    from schemas.events import ExtraFields, ScoredTrajectory
    from workers.trainer.batching import collate
    from workers.trainer.config import TrainerConfig
    from workers.trainer.logprobs import forward_log_probs
    from workers.trainer.packing import layout
    from workers.trainer.step import response_positions, routing

    model = AutoModelForCausalLM.from_pretrained(str(b_dir), dtype=torch.float32).eval()
    samples = [
        ScoredTrajectory(
            uid=f"s{i}",
            trajectory_id=f"s{i}/0",
            sample_index=0,
            attempt_id="a",
            data_source="bench",
            prompt_ids=s.prompt,
            response_ids=s.tokens,
            response_mask=[1] * len(s.tokens),
            response_logprobs=s.logprobs,
            num_turns=2,
            reward_score=0.0,
            extra_fields=ExtraFields(
                min_global_steps=s.versions[0], max_global_steps=s.versions[1]
            ),
            routed_experts=s.routing,
        )
        for i, s in enumerate(spans)
    ]
    batch = collate(samples)
    mask = batch["response_mask"] > 0
    old = torch.zeros_like(mask)
    for i, s in enumerate(spans):
        old[i, : s.old_tokens] = True
    rollout = batch["old_logprobs"]
    out: dict[str, Any] = {}
    for mode, name in (("off", "no_replay"), ("r3", "replay")):
        config = TrainerConfig(router_replay=mode)
        view = layout(batch)  # packed, as the trainer forwards; the routing packed alike
        with torch.no_grad(), routing(model, batch, config, view) as routed:
            logp, _ = forward_log_probs(model, batch, view)
        counts = routed.counts(view.take(response_positions(batch)))
        out[f"router_mismatch_rate_{name}"] = round(
            counts["router_mismatch_sum"] / counts["router_rows"], 4
        )
        diff = (logp - rollout).abs()
        for part, where in (("", mask), ("_old", mask & old), ("_new", mask & ~old)):
            out[f"logprob_max_abs_diff_{name}{part}"] = round(float(diff[where].max()), 5)
            out[f"logprob_mean_abs_diff_{name}{part}"] = round(float(diff[where].mean()), 5)
        if mode == "r3":
            out["router_live_mismatch_rate"] = round(
                counts["router_live_mismatch_sum"] / counts["router_rows"], 4
            )
    out["router_rows"] = counts["router_rows"]
    return out


def _decode(model_dir: str, rounds: int, threads: int) -> dict[str, Any]:
    """Decode tokens/s with routing returned vs not, interleaved rounds (step 5)."""
    from pipeline.harness.bench.moe_decode import decode_rate

    routed: list[float] = []
    plain: list[float] = []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)  # ABBA: neither side always first
        for flag in order:
            (routed if flag else plain).append(decode_rate(model_dir, flag, threads=threads))
    return {
        "decode_tokens_per_s_routed": round(statistics.median(routed), 1),
        "decode_tokens_per_s_plain": round(statistics.median(plain), 1),
        "decode_tokens_per_s_routed_runs": [round(x, 1) for x in routed],
        "decode_tokens_per_s_plain_runs": [round(x, 1) for x in plain],
        **paired_ratio(routed, plain, "decode_ratio"),
    }


def run(
    *,
    sequences: int = 8,
    max_tokens: int = 32,
    prompt_tokens: int = 16,
    lr: float = 1e-3,
    rounds: int = 3,
    threads: int = 1,
    seed: int = 0,
    model_dir: str | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    import torch

    from pipeline.harness.models.tiny import init_model

    torch.set_num_threads(threads)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rollout-bench-moe-") as tmp:
        root = Path(tmp)
        a_dir = Path(model_dir) if model_dir else init_model(root / "a", preset="moe", seed=seed)
        b_dir = root / "b"
        _next_checkpoint(a_dir, b_dir, lr, seed)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--backend", "hf"]
        argv += ["--model", str(a_dir), "--port", str(port), "--threads", str(threads)]
        replica = StageProcess("replica", argv, root / "replica.log")
        replica.start({**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)})
        try:
            wait_healthy(
                url, lambda: replica.alive, timeout_s, name="replica", log=root / "replica.log"
            )
            rng = random.Random(seed)
            prompts = [
                [rng.randrange(3, 1000) for _ in range(prompt_tokens)] for _ in range(sequences)
            ]
            spans = asyncio.run(_spanning(url, b_dir, prompts, max_tokens, seed))
        finally:
            replica.signal(15)
        if not spans:
            raise RuntimeError("no generation was in flight when the weights were updated")
        figures = _trainer_figures(b_dir, spans)
        config = _model_shape(a_dir)
        decode = _decode(str(a_dir), rounds, threads)
    first = spans[0].routing
    return {
        "benchmark": "moe",
        **config,
        "sequences": sequences,
        "spanning": len(spans),
        "old_tokens_mean": round(statistics.mean(s.old_tokens for s in spans), 2),
        "max_tokens": max_tokens,
        "prompt_tokens": prompt_tokens,
        "lr": lr,
        "routing_bytes_per_token": round(statistics.mean(s.wire_bytes_per_token for s in spans), 3),
        "routing_bytes_per_token_raw": first.layers * first.top_k,
        "moe_layers": first.layers,
        "experts": first.num_experts,
        "top_k": first.top_k,
        **figures,
        **decode,
        "wall_s": round(time.monotonic() - started, 1),
    }


def _model_shape(model_dir: Path) -> dict[str, Any]:
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    return {"architecture": cfg["architectures"][0], "layers": cfg["num_hidden_layers"]}
