"""Prefix-cache routing benchmark: sticky vs round-robin over real `hf` replica subprocesses.

Workload (agentic, prefill-heavy): `conversations` conversations of `turns` turns each. Turn 1's
prompt is a system prompt shared by every conversation (`system_tokens`) plus a task of its own
(`task_tokens`); turn k's prompt is turn k-1's prompt + its response + `tool_tokens` fresh "tool
output" tokens. Each turn generates exactly `gen_tokens` tokens (`ignore_eos`, seeded sampling),
so both phases do the same work. Token ids are drawn deterministically from the vocabulary,
never a special or added token. At most `concurrency` conversations are in flight (default: all
of them, like one rollout batch); each runs its turns one after another with its conversation
id as the request id. Concurrency matters: the `hf` engine's decode step costs milliseconds of
fixed overhead on the tiny model, so small batches make the work decode-bound and hide the
prefill that sticky routing saves.

Phases: the same workload runs through the normal `LLMClient` with `LLMClientConfig(routing=
...)`, against the same `replicas` subprocesses (`--threads 1`), `repeats` times per routing
policy in ABBA order (round-robin, sticky, sticky, round-robin, ...), so neither warm-up nor a
drift in the machine's load favours one policy; every replica is warmed before the first phase.
Before each phase every replica's prefix cache is dropped by reloading its own weights
(`/update_weights` clears the cache, per the engine's invariant), so no phase inherits another's;
then each replica computes the shared system prompt once (uncounted), the steady state of any
long run, where the tool-schema system prompt is cached after the first requests.

Figures per policy: the best wall time over its repeats (the one least disturbed by other load
on a shared machine), the replicas' CPU seconds (best repeat; robust to such load, Linux only),
and the prefix-cache hit rate from the replicas' `/metrics` deltas (hits / queries, both in
prompt tokens, over all repeats). `ideal_hit_rate` is the upper bound of this workload: every
prompt token that an earlier request on the same replica could have computed (the previous
turn's prompt + response minus its last token, whose KV is never computed, and the shared
system prompt), over all prompt tokens.

Wired as `rollout bench prefix-routing --json`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.launch.replicas import LocalReplicas

__all__ = ["run"]

logger = logging.getLogger("rollout.bench.prefix")

_PHASES = ("round_robin", "sticky")


@dataclass(frozen=True)
class _Workload:
    first: list[list[int]]  # per conversation: turn 1's prompt
    tools: list[list[list[int]]]  # per conversation, per turn >= 2: the tool output appended
    seeds: list[list[int]]  # per conversation, per turn: the sampling seed


def run(
    model_dir: str | None = None,
    conversations: int = 64,
    turns: int = 4,
    replicas: int = 4,
    tool_tokens: int = 256,
    gen_tokens: int = 32,
    concurrency: int = 64,
    seed: int = 0,
    *,
    system_tokens: int = 640,
    task_tokens: int = 64,
    prefix_cache_tokens: int = 32768,
    repeats: int = 2,
    startup_timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run both phases and return a JSON-ready dict of figures and settings.

    Keys: `sticky_hit_rate`, `roundrobin_hit_rate`, `sticky_wall_s`, `roundrobin_wall_s`,
    `ratio` (round-robin wall time / sticky wall time), `cpu_ratio` (the same for replica CPU
    seconds; None where /proc is missing), `ideal_hit_rate`, per-policy details (`phases`:
    every repeat's wall time, tokens, requests per replica) and every setting.
    """
    if min(conversations, turns, replicas, gen_tokens, concurrency, repeats) < 1:
        raise ValueError(
            "conversations, turns, replicas, gen_tokens, concurrency, repeats must be >= 1"
        )
    if min(tool_tokens, system_tokens, task_tokens) < 0 or system_tokens + task_tokens < 1:
        raise ValueError("token counts must be >= 0, and turn 1's prompt non-empty")
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        if model_dir is None:
            from pipeline.harness.models.tiny import init_model

            model_dir = str(init_model(Path(tmp) / "model", preset="tiny", seed=0))
        context = json.loads((Path(model_dir) / "config.json").read_text())[
            "max_position_embeddings"
        ]
        longest = system_tokens + task_tokens + (turns - 1) * (gen_tokens + tool_tokens)
        if longest + gen_tokens > context:
            raise ValueError(f"last turn needs {longest + gen_tokens} tokens > context {context}")
        workload = _workload(
            _allowed_ids(Path(model_dir)),
            conversations,
            turns,
            tool_tokens,
            system_tokens,
            task_tokens,
            seed,
        )
        reps = LocalReplicas(
            model_dir,
            replicas,
            threads=1,
            log_dir=Path(tmp) / "logs",
            env={"OMP_NUM_THREADS": "1"},
            extra_args=("--prefix-cache-tokens", str(prefix_cache_tokens)),
        )
        t0 = time.perf_counter()
        with reps.start(timeout_s=startup_timeout_s):
            logger.info("%d replicas healthy in %.1fs", replicas, time.perf_counter() - t0)
            order = [p for r in range(repeats) for p in (_PHASES if r % 2 == 0 else _PHASES[::-1])]
            runs = asyncio.run(
                _run_phases(
                    reps.addresses,
                    [proc.pid for proc in reps.procs],
                    model_dir,
                    workload,
                    order,
                    gen_tokens,
                    concurrency,
                    system_tokens,
                )
            )
    phases = {routing: _summary([r for p, r in runs if p == routing]) for routing in _PHASES}
    prompts = runs[0][1]["prompt_lengths"]
    ideal = _ideal_hits(prompts, gen_tokens, system_tokens) / max(1, sum(map(sum, prompts)))
    rr, st = phases["round_robin"], phases["sticky"]
    cpu_ratio = round(rr["cpu_s"] / st["cpu_s"], 3) if rr["cpu_s"] and st["cpu_s"] else None
    return {
        "benchmark": "prefix-routing",
        "sticky_hit_rate": st["hit_rate"],
        "roundrobin_hit_rate": rr["hit_rate"],
        "sticky_wall_s": st["wall_s"],
        "roundrobin_wall_s": rr["wall_s"],
        "ratio": round(rr["wall_s"] / st["wall_s"], 3),
        "cpu_ratio": cpu_ratio,
        "ideal_hit_rate": round(ideal, 4),
        "phases": phases,
        "phase_order": order,
        "repeats": repeats,
        "conversations": conversations,
        "turns": turns,
        "replicas": replicas,
        "tool_tokens": tool_tokens,
        "gen_tokens": gen_tokens,
        "system_tokens": system_tokens,
        "task_tokens": task_tokens,
        "concurrency": concurrency,
        "prefix_cache_tokens": prefix_cache_tokens,
        "threads_per_replica": 1,
        "seed": seed,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's repeats: best wall and CPU time, hit rate over all of them."""
    queries = sum(r["prompt_tokens"] for r in runs)
    hits = sum(r["cached_tokens"] for r in runs)
    cpus = [r["cpu_s"] for r in runs if r["cpu_s"] is not None]
    return {
        "wall_s": min(r["wall_s"] for r in runs),
        "walls_s": [r["wall_s"] for r in runs],
        "cpu_s": min(cpus) if cpus else None,
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prompt_tokens": runs[0]["prompt_tokens"],
        "cached_tokens": [r["cached_tokens"] for r in runs],
        "requests_per_replica": runs[0]["requests_per_replica"],
    }


# ---- workload -------------------------------------------------------------------------------


def _allowed_ids(model_dir: Path) -> list[int]:
    """Every token id of the vocabulary but the special and added ones (read from the files)."""
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    added: set[int] = set()
    tok = model_dir / "tokenizer.json"
    if tok.exists():
        added = {int(t["id"]) for t in json.loads(tok.read_text()).get("added_tokens", [])}
    return [i for i in range(vocab) if i not in added]


def _workload(
    ids: Sequence[int],
    conversations: int,
    turns: int,
    tool_tokens: int,
    system_tokens: int,
    task_tokens: int,
    seed: int,
) -> _Workload:
    rng = random.Random(seed)
    system = rng.choices(ids, k=system_tokens)
    first = [system + rng.choices(ids, k=task_tokens) for _ in range(conversations)]
    tools = [
        [rng.choices(ids, k=tool_tokens) for _ in range(turns - 1)] for _ in range(conversations)
    ]
    seeds = [[rng.getrandbits(31) for _ in range(turns)] for _ in range(conversations)]
    return _Workload(first, tools, seeds)


def _ideal_hits(prompts: list[list[int]], gen_tokens: int, system_tokens: int) -> int:
    """Prompt tokens whose KV an earlier request on the same replica computed, at best."""
    hits = 0
    for lengths in prompts:
        hits += system_tokens  # turn 1: the shared system prompt (the very first one misses)
        hits += sum(n + gen_tokens - 1 for n in lengths[:-1])  # turn k: all of turn k-1 but 1
    return hits


# ---- replicas -------------------------------------------------------------------------------


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds the processes have used so far (Linux /proc), else None."""
    total = 0
    try:
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def _named(urls: list[str]) -> list[Any]:
    from workers.llm.balancer import Replica

    return [Replica(f"r{i}", url) for i, url in enumerate(urls)]


async def _scrape(session: Any, urls: list[str]) -> dict[str, tuple[float, float]]:
    """Per replica URL: (prefix-cache queries, hits) in tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[float, float]] = {}
    for url in urls:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        values = {
            s.name: s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name.startswith("rollout_replica_prefix_cache_")
        }
        out[url] = (
            values["rollout_replica_prefix_cache_queries_total"],
            values["rollout_replica_prefix_cache_hits_total"],
        )
    return out


async def _reset(session: Any, urls: list[str], model_dir: str, version: int) -> None:
    """Drop every replica's prefix cache: a weight load (of the same weights) clears it."""
    body = {"path": str(model_dir), "version": version}
    for url in urls:
        async with session.post(f"{url}/update_weights", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: update_weights {resp.status}: {await resp.text()}")


# ---- phases ---------------------------------------------------------------------------------


async def _run_phases(
    urls: list[str],
    pids: list[int],
    model_dir: str,
    workload: _Workload,
    order: list[str],
    gen_tokens: int,
    concurrency: int,
    system_tokens: int,
) -> list[tuple[str, dict[str, Any]]]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _warm_up(urls, workload, gen_tokens)
        results: list[tuple[str, dict[str, Any]]] = []
        for version, routing in enumerate(order, start=1):
            await _reset(session, urls, model_dir, version)
            await _prime(urls, workload, system_tokens)
            before, cpu0 = await _scrape(session, urls), _cpu_seconds(pids)
            result = await _phase(urls, routing, workload, gen_tokens, concurrency)
            after, cpu1 = await _scrape(session, urls), _cpu_seconds(pids)
            queries = sum(after[u][0] - before[u][0] for u in urls)
            hits = sum(after[u][1] - before[u][1] for u in urls)
            result.update(
                prompt_tokens=int(queries),
                cached_tokens=int(hits),
                cpu_s=round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None,
            )
            logger.info(
                "phase %s: wall %.2fs, %d/%d tokens cached",
                routing,
                result["wall_s"],
                hits,
                queries,
            )
            results.append((routing, result))
    return results


async def _prime(urls: list[str], workload: _Workload, system_tokens: int) -> None:
    """Steady state for both policies alike: the shared system prompt is cached on every
    replica, as it is after the first requests of any long run (not counted in the figures)."""
    from workers.llm.client import LLMClient, LLMClientConfig

    if system_tokens <= 0:
        return
    system = workload.first[0][:system_tokens]
    params = {"max_tokens": 1, "ignore_eos": True, "seed": 0, "logprobs": None}
    async with LLMClient(
        LLMClientConfig(routing="round_robin", max_retries=0), replicas=_named(urls)
    ) as client:
        for i in range(len(urls)):
            await client.generate(f"prime-{i}", system, params)


async def _warm_up(urls: list[str], workload: _Workload, gen_tokens: int) -> None:
    """One long request per replica, so neither phase pays the first forwards of a cold process."""
    from workers.llm.client import LLMClient, LLMClientConfig

    cfg = LLMClientConfig(routing="round_robin", max_retries=0)
    prompt = workload.first[-1] + [t for block in workload.tools[-1] for t in block]
    params = {"max_tokens": gen_tokens, "ignore_eos": True, "seed": 0, "logprobs": None}
    async with LLMClient(cfg, replicas=_named(urls)) as client:
        await asyncio.gather(
            *(client.generate(f"warmup-{i}", prompt[::-1], params) for i in range(len(urls)))
        )


async def _phase(
    urls: list[str], routing: str, workload: _Workload, gen_tokens: int, concurrency: int
) -> dict[str, Any]:
    from workers.llm.client import LLMClient, LLMClientConfig

    cfg = LLMClientConfig(routing=routing, deterministic=True, max_retries=0)  # type: ignore[arg-type]
    per_replica: dict[str, int] = {}
    lengths: list[list[int]] = [[] for _ in workload.first]
    gate = asyncio.Semaphore(concurrency)

    async def conversation(c: int) -> None:
        prompt = list(workload.first[c])
        async with gate:
            for turn, seed in enumerate(workload.seeds[c]):
                if turn:
                    prompt += workload.tools[c][turn - 1]
                lengths[c].append(len(prompt))
                params = {"max_tokens": gen_tokens, "ignore_eos": True, "seed": seed}
                out = await client.generate(f"conv-{c}", prompt, params)
                if len(out.token_ids) != gen_tokens:
                    raise RuntimeError(f"conv-{c} turn {turn}: {len(out.token_ids)} tokens")
                for rid in out.replicas:
                    per_replica[rid] = per_replica.get(rid, 0) + 1
                prompt += out.token_ids

    async with LLMClient(cfg, replicas=_named(urls)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(len(workload.first))))
        wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 3),
        "requests_per_replica": dict(sorted(per_replica.items())),
        "prompt_lengths": lengths,
    }
