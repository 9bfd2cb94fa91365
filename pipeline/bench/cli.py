"""The `rollout bench …` commands: each prints one JSON object with `--json`.

Every benchmark measures its baseline in the same run and reports a ratio (this machine is
shared and noisy; absolute times mean little). Heavy modules are imported inside each command.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig

__all__ = ["add_bench_parsers"]

Handler = Callable[[argparse.Namespace, RunConfig], int]


def _bench(
    module: str,
    names: str,
    *,
    kafka: bool = False,
    model: str | None = None,
    extra: Callable[[argparse.Namespace, RunConfig], dict[str, Any]] | None = None,
) -> Handler:
    """The handler of a benchmark that is `pipeline.bench.<module>.run(...)` of its flags.

    `names`: the keyword arguments taken from the flags of the same name, space-separated
    (`kw=flag` to rename); `kafka`: the run's `KafkaConfig` goes first; `model`: that flag
    (`model` or `tokenizer`) must name a model directory when given; `extra`: more keyword
    arguments.
    """
    pairs = [(kw, flag or kw) for kw, _, flag in (n.partition("=") for n in names.split())]

    def handler(args: argparse.Namespace, cfg: RunConfig) -> int:
        if model is not None:
            _checked_model(args, model)
        run = importlib.import_module(f"pipeline.bench.{module}").run
        kwargs = {kw: getattr(args, flag) for kw, flag in pairs}
        kwargs.update(extra(args, cfg) if extra else {})
        _emit(run(*([cfg.kafka] if kafka else []), **kwargs), args.json)
        return 0

    return handler


_MODEL = "model_dir=model"
cmd_bench_serialization = _bench("serialization", "tokens rounds")
cmd_bench_router = _bench("router", "replicas ids")
cmd_bench_prefix = _bench(
    "prefix", f"{_MODEL} conversations concurrency system_tokens task_tokens", model="model"
)
cmd_bench_reward = _bench(
    "reward",
    "trajectories turns tokens pool_workers batch_size tokenizer",
    kafka=True,
    model="tokenizer",
)
cmd_bench_async = _bench(
    "async_speedup", f"steps batch n max_tokens {_MODEL}", kafka=True, model="model"
)
cmd_bench_agent_loop = _bench("agent_loop", f"prompts rounds {_MODEL}", kafka=True, model="model")
cmd_bench_vllm = _bench(
    "vllm",
    f"requests concurrency max_tokens rounds {_MODEL} log_dir",
    kafka=True,
    extra=lambda args, cfg: {"vllm_python": args.vllm_python or cfg.vllm.python},
)
cmd_bench_pipeline = _bench(
    "end_to_end",
    f"prompts n max_tokens replicas raw_messages {_MODEL}",
    kafka=True,
    model="model",
)
cmd_bench_train_step = _bench("train_step", "groups n response_tokens mini_batches epochs rounds")
cmd_bench_fsdp = _bench("fsdp", "ranks")
cmd_bench_routing = _bench(
    "routing",
    f"prompts n max_tokens workers in_flight big_batch small_batch rounds {_MODEL}",
    kafka=True,
    model="model",
)


def cmd_bench_engine(args: argparse.Namespace, cfg: RunConfig) -> int:
    _checked_model(args)
    import tempfile

    from pipeline.bench.engine import run

    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from workers.llm.model_init import init_model

            model = str(init_model(Path(tmp) / "model", preset="tiny", seed=0))
        _emit(run(model, concurrency=args.concurrency), args.json)
    return 0


def cmd_bench_learn(args: argparse.Namespace, cfg: RunConfig) -> int:
    from dataclasses import fields, replace

    from pipeline.bench.learn import run
    from pipeline.demo_recipe import DemoRecipe

    recipe = DemoRecipe()
    types = {f.name: type(getattr(recipe, f.name)) for f in fields(DemoRecipe)}
    changes: dict[str, Any] = {}
    for pair in args.recipe:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise SystemExit(f"rollout bench learn: --recipe {pair!r}: use KEY=VALUE, KEY one of "
                             f"{', '.join(sorted(types))}")  # fmt: skip
        kind = types[key]
        changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    recipe = replace(recipe, **changes)
    try:
        staleness = [int(x) for x in args.staleness.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"rollout bench learn: --staleness {args.staleness!r}: e.g. 0,2") from None

    def progress(result: dict[str, Any]) -> None:
        print(f"seed {result['seed']} η={result['max_staleness']}: {result['first']:.3f} → "
              f"{result['last']:.3f} ({result['delta']:+.3f}) in {result['wall_s']:.0f}s",
              file=sys.stderr, flush=True)  # fmt: skip

    result = run(cfg, runs=args.runs, staleness=staleness, recipe=recipe, seed=args.seed,
                 target=args.target, out_dir=args.out, progress=progress)  # fmt: skip
    _emit(result, args.json)
    return 0


def _checked_model(args: argparse.Namespace, flag: str = "model") -> None:
    """A given --model (or --tokenizer) must be a model directory: one line now, not a
    traceback from a stage's log after the pipeline started."""
    from pipeline.cli_stages import checked_model_dir

    if getattr(args, flag, None):
        setattr(args, flag, checked_model_dir(getattr(args, flag), f"--{flag}"))


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")


def add_bench_parsers(sub: Any) -> None:
    bench = sub.add_parser("bench", help="Benchmarks; each prints one JSON object with --json.")
    bsub = bench.add_subparsers(dest="benchmark", required=True)
    ser = bsub.add_parser("serialization", help="Wire codec vs plain JSON lists.")
    ser.add_argument("--tokens", type=int, default=4096)
    ser.add_argument("--rounds", type=int, default=5)
    ser.add_argument("--json", action="store_true")
    ser.set_defaults(handler=cmd_bench_serialization)
    router = bsub.add_parser("router", help="Balancer acquire+release pairs per second.")
    router.add_argument("--replicas", type=int, default=8)
    router.add_argument("--ids", type=int, default=10_000)
    router.add_argument("--json", action="store_true")
    router.set_defaults(handler=cmd_bench_router)
    engine = bsub.add_parser("engine", help="hf engine: concurrent vs serial tokens/s.")
    engine.add_argument("--model", help="Model directory (default: build the tiny model).")
    engine.add_argument("--concurrency", type=int, default=16)
    engine.add_argument("--json", action="store_true")
    engine.set_defaults(handler=cmd_bench_engine)
    prefix = bsub.add_parser("prefix-routing", help="Sticky vs round-robin over 4 hf replicas.")
    prefix.add_argument("--model", help="Model directory (default: build the tiny model).")
    prefix.add_argument("--conversations", type=int, default=64)
    prefix.add_argument("--concurrency", type=int, default=64)
    prefix.add_argument(
        "--system-tokens", type=int, default=640, help="Shared system prompt (tool schemas)."
    )
    prefix.add_argument("--task-tokens", type=int, default=64, help="Each conversation's own task.")
    prefix.add_argument("--json", action="store_true")
    prefix.set_defaults(handler=cmd_bench_prefix)
    reward_bench = bsub.add_parser("reward", help="Reward stage vs a bare consume→produce copy.")
    reward_bench.add_argument("--trajectories", type=int, default=2000)
    reward_bench.add_argument("--turns", type=int, default=4)
    reward_bench.add_argument("--tokens", type=int, default=256)
    reward_bench.add_argument("--pool-workers", type=int, default=2)
    reward_bench.add_argument("--batch-size", type=int, default=1024)
    reward_bench.add_argument("--tokenizer", help="Model/tokenizer directory (default: build one).")
    reward_bench.add_argument("--json", action="store_true")
    reward_bench.set_defaults(handler=cmd_bench_reward)
    speedup = bsub.add_parser("async-speedup", help="max_staleness 0 vs 2, same steps, same run.")
    speedup.add_argument("--steps", type=int, default=8)
    speedup.add_argument("--batch", type=int, default=2, help="Groups per trainer step.")
    speedup.add_argument("--n", type=int, default=4, help="Samples per prompt.")
    speedup.add_argument("--max-tokens", type=int, default=48)
    speedup.add_argument("--model", help="Model directory (default: build the tiny model).")
    speedup.add_argument("--json", action="store_true")
    speedup.set_defaults(handler=cmd_bench_async)
    agent_bench = bsub.add_parser("agent-loop", help="Agent loops direct vs through Kafka.")
    agent_bench.add_argument("--prompts", type=int, default=96, help="Prompts per side per round.")
    agent_bench.add_argument("--rounds", type=int, default=5, help="Rounds (each runs both sides).")
    agent_bench.add_argument("--model", help="Model directory (default: build the tiny model).")
    agent_bench.add_argument("--json", action="store_true")
    agent_bench.set_defaults(handler=cmd_bench_agent_loop)
    vllm = bsub.add_parser("vllm", help="vLLM direct vs the contract vs Kafka; logprob drift.")
    vllm.add_argument("--requests", type=int, default=32)
    vllm.add_argument("--concurrency", type=int, default=8)
    vllm.add_argument("--max-tokens", type=int, default=128)
    vllm.add_argument("--rounds", type=int, default=3)
    vllm.add_argument("--model", help="Model directory (default: build the tiny model).")
    vllm.add_argument("--vllm-python", help="Interpreter with vLLM (default: .venv-vllm's).")
    vllm.add_argument("--log-dir", help="Where the replica's log goes (default: a temp dir).")
    vllm.add_argument("--json", action="store_true")
    vllm.set_defaults(handler=cmd_bench_vllm)
    e2e = bsub.add_parser("pipeline", help="End-to-end trajectories/s, 1 and 2 agent-loop workers.")
    e2e.add_argument("--prompts", type=int, default=48)
    e2e.add_argument("--n", type=int, default=4, help="Samples per prompt.")
    e2e.add_argument("--max-tokens", type=int, default=16)
    e2e.add_argument("--replicas", type=int, default=2)
    e2e.add_argument("--raw-messages", type=int, default=5000, help="Baseline message count.")
    e2e.add_argument("--model", help="Model directory (default: build the tiny model).")
    e2e.add_argument("--json", action="store_true")
    e2e.set_defaults(handler=cmd_bench_pipeline)
    learn = bsub.add_parser("learn", help="N independent demo pipelines: does each one learn?")
    learn.add_argument("--runs", type=int, default=10, help="Independent runs (seeds) per η.")
    learn.add_argument("--staleness", default="2", help="max_staleness values, e.g. 0,2.")
    learn.add_argument("--seed", type=int, default=0, help="Seed of the first run.")
    learn.add_argument("--recipe", action="append", default=[], metavar="KEY=VALUE",
                       help="Override a field of the demo recipe (repeatable).")  # fmt: skip
    learn.add_argument("--target", type=float, default=0.6,
                       help="Reward (mean of 5 steps) that times time_to_reward_s.")  # fmt: skip
    learn.add_argument("--out", help="Keep every run's directory here (default: a temp dir).")
    learn.add_argument("--json", action="store_true")
    learn.set_defaults(handler=cmd_bench_learn)
    step = bsub.add_parser("train-step", help="Trainer step: one update vs PPO mini-batches.")
    step.add_argument("--groups", type=int, default=8)
    step.add_argument("--n", type=int, default=8, help="Samples per group.")
    step.add_argument("--response-tokens", type=int, default=8)
    step.add_argument("--mini-batches", type=int, default=2)
    step.add_argument("--epochs", type=int, default=1)
    step.add_argument("--rounds", type=int, default=7)
    step.add_argument("--json", action="store_true")
    step.set_defaults(handler=cmd_bench_train_step)
    fsdp = bsub.add_parser("fsdp", help="One trainer step: 1 process vs N FSDP2 gloo ranks.")
    fsdp.add_argument("--ranks", type=int, default=2)
    fsdp.add_argument("--json", action="store_true")
    fsdp.set_defaults(handler=cmd_bench_fsdp)
    routing = bsub.add_parser("routing", help="Load-aware vs local-only routing, 3 workers.")
    routing.add_argument("--prompts", type=int, default=16)
    routing.add_argument("--n", type=int, default=4, help="Samples per prompt.")
    routing.add_argument("--max-tokens", type=int, default=32)
    routing.add_argument("--workers", type=int, default=3, help="Agent-loop worker processes.")
    routing.add_argument("--in-flight", type=int, default=8, help="Samples in flight per worker.")
    routing.add_argument("--big-batch", type=int, default=16, help="The big replica's max batch.")
    routing.add_argument("--small-batch", type=int, default=1, help="The small one's.")
    routing.add_argument("--rounds", type=int, default=2, help="Runs of each mode (ABBA order).")
    routing.add_argument("--model", help="Model directory (default: build the tiny model).")
    routing.add_argument("--json", action="store_true")
    routing.set_defaults(handler=cmd_bench_routing)
