"""The `rollout bench …` commands: each prints one JSON object with `--json`.

Every benchmark measures its baseline in the same run and reports a ratio (this machine is
shared and noisy; absolute times mean little). Heavy modules are imported inside each command.
Each benchmark is one row of `BENCHES`: its parser and its command both come from that row.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.cli.options import add_flag
from pipeline.config import RunConfig

__all__ = ["add_parsers"]

Handler = Callable[[argparse.Namespace, RunConfig], int]


def cmd_bench_engine(args: argparse.Namespace, cfg: RunConfig) -> int:
    _checked_model(args)
    import tempfile

    from pipeline.harness.bench.engine import run

    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from pipeline.harness.models.tiny import init_model

            model = str(init_model(Path(tmp) / "model", preset="tiny", seed=0))
        _emit(run(model, concurrency=args.concurrency), args.json)
    return 0


def cmd_bench_learn(args: argparse.Namespace, cfg: RunConfig) -> int:
    from dataclasses import fields, replace

    from pipeline.harness.bench.learn import run
    from pipeline.harness.recipe import DemoRecipe

    recipe = DemoRecipe()
    types = {f.name: type(getattr(recipe, f.name)) for f in fields(DemoRecipe)}
    changes: dict[str, Any] = {}
    for pair in args.recipe:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise SystemExit(
                f"rollout bench learn: --recipe {pair!r}: use KEY=VALUE, KEY one of "
                f"{', '.join(sorted(types))}"
            )
        kind = types[key]
        changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    recipe = replace(recipe, **changes)
    try:
        staleness = [int(x) for x in args.staleness.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"rollout bench learn: --staleness {args.staleness!r}: e.g. 0,2") from None

    def progress(result: dict[str, Any]) -> None:
        print(
            f"seed {result['seed']} η={result['max_staleness']}: {result['first']:.3f} → "
            f"{result['last']:.3f} ({result['delta']:+.3f}) in {result['wall_s']:.0f}s",
            file=sys.stderr,
            flush=True,
        )

    result = run(
        cfg,
        runs=args.runs,
        staleness=staleness,
        recipe=recipe,
        seed=args.seed,
        target=args.target,
        out_dir=args.out,
        progress=progress,
    )
    _emit(result, args.json)
    return 0


def _checked_model(args: argparse.Namespace, flag: str = "model") -> None:
    """A given --model (or --tokenizer) must be a model directory: one line now, not a
    traceback from a stage's log after the pipeline started."""
    from pipeline.cli.common import checked_model_dir

    if getattr(args, flag, None):
        setattr(args, flag, checked_model_dir(getattr(args, flag), f"--{flag}"))


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")


@dataclass(frozen=True)
class Bench:
    """One `rollout bench NAME`, by default `pipeline.harness.bench.NAME.run(...)` of its flags (the
    module is the command's name with dashes as underscores).

    `flags`: each a default or (default, help); `pool_workers` is `--pool-workers`, the type is
    the default's (str for None), and each reaches `run` as the keyword of its name. `model`
    adds `--model` (its help `model_help`), which reaches `run` as `model_dir`; `check` names
    the flag that must name a model directory when given (`--model` unless told otherwise).
    `kafka`: the run's `KafkaConfig` goes first; `extra`: more keyword arguments. `command`: a
    handler of its own instead (it reads the flags itself). Every benchmark takes `--json`.
    """

    name: str
    text: str
    flags: dict[str, Any] = field(default_factory=dict)
    kafka: bool = False
    model: bool = False
    check: str | None = "model"
    model_help: str = "Model directory (default: build the tiny model)."
    extra: Callable[[argparse.Namespace, RunConfig], dict[str, Any]] | None = None
    command: Handler | None = None

    def handler(self, args: argparse.Namespace, cfg: RunConfig) -> int:
        if self.command is not None:
            return self.command(args, cfg)
        if self.check is not None:
            _checked_model(args, self.check)
        run = importlib.import_module(f"pipeline.harness.bench.{self.name.replace('-', '_')}").run
        kwargs = {flag: getattr(args, flag) for flag in self.flags}
        if self.model:
            kwargs["model_dir"] = args.model
        kwargs.update(self.extra(args, cfg) if self.extra else {})
        _emit(run(*([cfg.kafka] if self.kafka else []), **kwargs), args.json)
        return 0

    def add_parser(self, bsub: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = bsub.add_parser(self.name, help=self.text)
        for key, value in self.flags.items():
            default, help_ = value if isinstance(value, tuple) else (value, None)
            add_flag(parser, key, default, help_ or _FLAG_HELP[key])
        if self.model:
            parser.add_argument("--model", help=self.model_help)
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")
        parser.set_defaults(handler=self.handler)
        return parser


_SAMPLES_PER_PROMPT = (4, "Samples per prompt.")

#: The help of a flag that several benchmarks share, where its entry gives none.
_FLAG_HELP = {
    "tokens": "Tokens per message (or per turn).",
    "rounds": "Measured rounds (the figures are their median).",
    "replicas": "Replicas.",
    "ids": "Distinct request ids.",
    "concurrency": "Requests in flight at once.",
    "conversations": "Conversations (each a run of turns).",
    "trajectories": "Trajectories.",
    "turns": "Turn events per trajectory.",
    "pool_workers": "Scorer process-pool workers.",
    "batch_size": "Records per stage batch.",
    "steps": "Trainer steps.",
    "max_tokens": "Tokens generated per sample at most.",
    "requests": "Requests.",
    "prompts": "Prompts.",
    "groups": "Groups per step.",
    "response_tokens": "Tokens per response.",
    "mini_batches": "PPO mini-batches per step.",
    "epochs": "PPO epochs per step.",
    "ranks": "gloo ranks.",
}

BENCHES: tuple[Bench, ...] = (
    Bench(
        "serialization",
        "Wire codec vs plain JSON lists.",
        {"tokens": 4096, "rounds": 5},
    ),
    Bench(
        "router",
        "Balancer acquire+release pairs per second.",
        {"replicas": 8, "ids": 10_000},
    ),
    Bench(
        "engine",
        "hf engine: concurrent vs serial tokens/s.",
        flags={"concurrency": 16},
        model=True,
        command=cmd_bench_engine,
    ),
    Bench(
        "prefix-routing",
        "Sticky vs round-robin over 4 hf replicas.",
        {
            "conversations": 64,
            "concurrency": 64,
            "system_tokens": (640, "Shared system prompt (tool schemas)."),
            "task_tokens": (64, "Each conversation's own task."),
        },
        model=True,
    ),
    Bench(
        "reward",
        "Reward stage vs a bare consume→produce copy.",
        {
            "trajectories": 2000,
            "turns": 4,
            "tokens": 256,
            "pool_workers": 2,
            "batch_size": 1024,
            "tokenizer": (None, "Model/tokenizer directory (default: build one)."),
        },
        kafka=True,
        check="tokenizer",
    ),
    Bench(
        "async-speedup",
        "max_staleness 0 vs 2, same steps, same run.",
        {
            "steps": 8,
            "batch": (2, "Groups per trainer step."),
            "n": _SAMPLES_PER_PROMPT,
            "max_tokens": 48,
        },
        kafka=True,
        model=True,
    ),
    Bench(
        "agent-loop",
        "Agent loops direct vs through Kafka.",
        {
            "prompts": (96, "Prompts per side per round."),
            "rounds": (9, "Rounds (each runs both sides)."),
            "workers": (1, "2: also run every round through 2 worker processes."),
            "cpu_split": (1, "0: leave the processes unpinned (no fair CPU split)."),
        },
        kafka=True,
        model=True,
    ),
    Bench(
        "vllm",
        "vLLM direct vs the contract vs Kafka; logprob drift.",
        {
            "requests": 32,
            "concurrency": 8,
            "max_tokens": 128,
            "rounds": 3,
            "vllm_python": (None, "Interpreter with vLLM (default: .venv-vllm's)."),
            "log_dir": (None, "Where the replica's log goes (default: a temp dir)."),
        },
        kafka=True,
        model=True,
        check=None,
        extra=lambda args, cfg: {"vllm_python": args.vllm_python or cfg.vllm.python},
    ),
    Bench(
        "pipeline",
        "End-to-end trajectories/s, 1 and 2 agent-loop workers.",
        {
            "prompts": 48,
            "n": _SAMPLES_PER_PROMPT,
            "max_tokens": 16,
            "replicas": 2,
            "raw_messages": (5000, "Baseline message count."),
        },
        kafka=True,
        model=True,
    ),
    Bench(
        "learn",
        "N independent demo pipelines: does each one learn?",
        flags={
            "runs": (10, "Independent runs (seeds) per η."),
            "staleness": ("2", "max_staleness values, e.g. 0,2."),
            "seed": (0, "Seed of the first run."),
            "target": (0.6, "Reward (mean of 5 steps) that times time_to_reward_s."),
            "out": (None, "Keep every run's directory here (default: a temp dir)."),
        },
        command=cmd_bench_learn,
    ),
    Bench(
        "train-step",
        "Trainer step vs bare padded and packed forward+backward of the same tokens.",
        {
            "device": ("auto", "cpu, cuda, cuda:N or auto."),
            "geometry": ("tiny", "Model shape, random weights: tiny or qwen2-0.5b."),
            "batch": ("rl", "rl (RL-shaped lengths) or uniform."),
            "rounds": (7, "Measured rounds (ratios: their median; tokens/s: the fastest)."),
            "threads": (1, "torch intra-op threads (1: steadier on a shared CPU)."),
            "micro_batch_size": (8, "Samples per micro-batch of the padded sides."),
            "max_tokens": (0, "Token budget of a packed micro-batch (0: as many as by count)."),
            "padded_step": (1, "1: also time the step in the padded layout (the old trainer)."),
            "profile": (0, "1: add the top operators of one project step."),
            "seed": (0, "Seed of the batch and the weights."),
        },
    ),
    Bench("fsdp", "One trainer step: 1 process vs N FSDP2 gloo ranks.", {"ranks": 2}),
    Bench(
        "lend",
        "The demo's pipeline to N steps, the idle trainer lent to generation or not.",
        {
            "steps": 20,
            "seed": (0, "Seed of the recipe (model, warm start, prompts, trainer)."),
            "max_tokens": 16,
            "reclaim_ratio": (0.75, "trainer.lend.reclaim_ratio of the lent run."),
            "ignore_eos": (0, "1: every response runs to --max-tokens (rollout-bound)."),
            "max_staleness": (2, "trainer.max_staleness of both runs (0: synchronous)."),
            "max_batch": (0, "Rows each engine decodes at once (0: their default, 64)."),
            "deadline_s": (1200.0, "Seconds each run may take at most."),
        },
        kafka=True,
    ),
    Bench(
        "weight-sync",
        "Seconds per weight sync: checkpoint on disk vs broadcast, per model size.",
        {
            "sizes": ("small,0.5b", "Models: presets (tiny, small) and 0.5b (synthetic)."),
            "rounds": 5,
            "bucket_mb": (256, "Broadcast bucket size in MiB."),
            "dtype": (
                "bfloat16",
                "The dtype the replica serves (float32, bfloat16): broadcast weights travel "
                "in it; the trainer's are fp32.",
            ),
        },
    ),
    Bench(
        "moe",
        "MoE routing replay: router mismatch, logprob drift, routing's cost.",
        {
            "sequences": (8, "Generations resumed across a weight update."),
            "max_tokens": 32,
            "prompt_tokens": (16, "Prompt tokens per generation."),
            "lr": (1e-3, "lr of the trainer step from checkpoint A to B."),
            "rounds": (3, "Decode-rate rounds (each measures both sides)."),
            "threads": (1, "torch threads of the replica and the trainer."),
        },
        model=True,
        model_help="A MoE model directory, checkpoint A (default: build the moe preset).",
    ),
    Bench(
        "moe-decode",
        "hf engine on a MoE model: decode tokens/s, routed experts returned vs not.",
        {
            "rounds": (5, "Rounds (each measures both sides)."),
            "rows": (8, "Generations decoded at once."),
            "max_tokens": 64,
            "threads": (1, "torch threads of the engine."),
        },
        model=True,
        model_help="A MoE model directory (default: build the moe preset).",
    ),
    Bench(
        "failover",
        "Three brokers, the pipeline running, the leader of rl.turns SIGKILLed: rates, stall.",
        {
            "runs": (3, "Runs, each on a cluster of its own."),
            "samples": (4000, "Samples produced for each run (enough to outlast it)."),
            "before_s": (30.0, "Seconds measured before the kill."),
            "after_s": (30.0, "Seconds measured once the cluster is whole again."),
            "down_s": (10.0, "Seconds the killed broker stays down."),
            "replicas": 2,
            "workers": (2, "Agent-loop worker processes."),
            "seed": (0, "Seed of the first run (the next runs: +1, +2)."),
        },
        check=None,
    ),
    Bench(
        "routing",
        "Load-aware vs local-only routing, 3 workers.",
        {
            "prompts": 16,
            "n": _SAMPLES_PER_PROMPT,
            "max_tokens": 32,
            "workers": (3, "Agent-loop worker processes."),
            "in_flight": (8, "Samples in flight per worker."),
            "big_batch": (16, "The big replica's max batch."),
            "small_batch": (1, "The small one's."),
            "rounds": (2, "Runs of each mode (ABBA order)."),
        },
        kafka=True,
        model=True,
    ),
)


def add_parsers(sub: Any) -> None:
    bench = sub.add_parser("bench", help="Benchmarks; each prints one JSON object with --json.")
    b = bench.add_subparsers(dest="benchmark", required=True)
    parsers = {spec.name: spec.add_parser(b) for spec in BENCHES}
    parsers["learn"].add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a field of the demo recipe (repeatable).",
    )
