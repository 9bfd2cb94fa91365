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
    from pipeline.cli_stages import checked_model_dir

    if getattr(args, flag, None):
        setattr(args, flag, checked_model_dir(getattr(args, flag), f"--{flag}"))


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")


_MODEL_HELP = "Model directory (default: build the tiny model)."


def _bench(
    bsub: Any, name: str, text: str, handler: Any, *, model: bool = False, **options: Any
) -> Any:
    """One `rollout bench NAME` parser. `options` are its flags (`pool_workers` is
    `--pool-workers`), each a default or (default, help); the type is the default's (str for
    None). `model` adds `--model`; every benchmark takes `--json`."""
    parser = bsub.add_parser(name, help=text)
    for key, value in options.items():
        default, help_ = value if isinstance(value, tuple) else (value, None)
        kind = str if default is None else type(default)
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind, default=default, help=help_)
    if model:
        parser.add_argument("--model", help=_MODEL_HELP)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(handler=handler)
    return parser


def add_bench_parsers(sub: Any) -> None:
    bench = sub.add_parser("bench", help="Benchmarks; each prints one JSON object with --json.")
    b = bench.add_subparsers(dest="benchmark", required=True)
    _bench(
        b,
        "serialization",
        "Wire codec vs plain JSON lists.",
        cmd_bench_serialization,
        tokens=4096,
        rounds=5,
    )
    _bench(
        b,
        "router",
        "Balancer acquire+release pairs per second.",
        cmd_bench_router,
        replicas=8,
        ids=10_000,
    )
    _bench(
        b,
        "engine",
        "hf engine: concurrent vs serial tokens/s.",
        cmd_bench_engine,
        model=True,
        concurrency=16,
    )
    _bench(
        b,
        "prefix-routing",
        "Sticky vs round-robin over 4 hf replicas.",
        cmd_bench_prefix,
        model=True,
        conversations=64,
        concurrency=64,
        system_tokens=(640, "Shared system prompt (tool schemas)."),
        task_tokens=(64, "Each conversation's own task."),
    )
    _bench(
        b,
        "reward",
        "Reward stage vs a bare consume→produce copy.",
        cmd_bench_reward,
        trajectories=2000,
        turns=4,
        tokens=256,
        pool_workers=2,
        batch_size=1024,
        tokenizer=(None, "Model/tokenizer directory (default: build one)."),
    )
    _bench(
        b,
        "async-speedup",
        "max_staleness 0 vs 2, same steps, same run.",
        cmd_bench_async,
        model=True,
        steps=8,
        batch=(2, "Groups per trainer step."),
        n=(4, "Samples per prompt."),
        max_tokens=48,
    )
    _bench(
        b,
        "agent-loop",
        "Agent loops direct vs through Kafka.",
        cmd_bench_agent_loop,
        model=True,
        prompts=(96, "Prompts per side per round."),
        rounds=(9, "Rounds (each runs both sides)."),
    )
    _bench(
        b,
        "vllm",
        "vLLM direct vs the contract vs Kafka; logprob drift.",
        cmd_bench_vllm,
        model=True,
        requests=32,
        concurrency=8,
        max_tokens=128,
        rounds=3,
        vllm_python=(None, "Interpreter with vLLM (default: .venv-vllm's)."),
        log_dir=(None, "Where the replica's log goes (default: a temp dir)."),
    )
    _bench(
        b,
        "pipeline",
        "End-to-end trajectories/s, 1 and 2 agent-loop workers.",
        cmd_bench_pipeline,
        model=True,
        prompts=48,
        n=(4, "Samples per prompt."),
        max_tokens=16,
        replicas=2,
        raw_messages=(5000, "Baseline message count."),
    )
    learn = _bench(
        b,
        "learn",
        "N independent demo pipelines: does each one learn?",
        cmd_bench_learn,
        runs=(10, "Independent runs (seeds) per η."),
        staleness=("2", "max_staleness values, e.g. 0,2."),
        seed=(0, "Seed of the first run."),
        target=(0.6, "Reward (mean of 5 steps) that times time_to_reward_s."),
        out=(None, "Keep every run's directory here (default: a temp dir)."),
    )
    learn.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a field of the demo recipe (repeatable).",
    )
    _bench(
        b,
        "train-step",
        "Trainer step: one update vs PPO mini-batches.",
        cmd_bench_train_step,
        groups=8,
        n=(8, "Samples per group."),
        response_tokens=8,
        mini_batches=2,
        epochs=1,
        rounds=7,
    )
    _bench(b, "fsdp", "One trainer step: 1 process vs N FSDP2 gloo ranks.", cmd_bench_fsdp, ranks=2)
    _bench(
        b,
        "routing",
        "Load-aware vs local-only routing, 3 workers.",
        cmd_bench_routing,
        model=True,
        prompts=16,
        n=(4, "Samples per prompt."),
        max_tokens=32,
        workers=(3, "Agent-loop worker processes."),
        in_flight=(8, "Samples in flight per worker."),
        big_batch=(16, "The big replica's max batch."),
        small_batch=(1, "The small one's."),
        rounds=(2, "Runs of each mode (ABBA order)."),
    )
