"""`rollout produce|consume|data|model`: datasets into the prompts topic, topics out as JSON
lines, and the generated datasets and tiny models the project trains on."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.common import at_least, print_json, writable_dir
from pipeline.config import ConfigError, RunConfig
from pipeline.harness.models.templates import FAMILY_NAMES

__all__ = ["add_parsers"]


def cmd_produce(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.data.datasets import dataset_uid_prefix, read_rows
    from pipeline.data.producer import PromptProducer
    from pipeline.topics import require_topics

    rows = read_rows(args.dataset)  # a wrong path or format fails here, before Kafka
    for name, outcome in require_topics(cfg.kafka, cfg.topics, ["prompts"]).items():
        print(f"{name}\t{outcome}", file=sys.stderr)
    check = None if args.allow_unscorable else cfg.reward.unscorable
    with PromptProducer(cfg.kafka, cfg.topics, cfg.media, unscorable=check) as producer:
        report = producer.produce_rows(
            rows,
            uid_prefix=args.uid_prefix or dataset_uid_prefix(args.dataset),
            default_data_source=cfg.produce.default_data_source,
            limit=args.limit,
            rate=args.rate or cfg.produce.rate,
            progress=not args.quiet,
        )
    for error in report.errors[:20]:
        print(f"skipped {error}", file=sys.stderr)
    if len(report.errors) > 20:
        print(f"… and {len(report.errors) - 20} more", file=sys.stderr)
    print(report.summary(), file=sys.stderr)
    print_json(
        {"sent": report.sent, "skipped": report.skipped, "seconds": round(report.seconds, 3)}
    )
    if report.sent == 0 and args.limit != 0:
        what = "no valid row" if report.skipped else "no rows"
        print(f"rollout: error: nothing produced: {args.dataset} has {what}", file=sys.stderr)
        return 1
    return 0


def cmd_consume(args: argparse.Namespace, cfg: RunConfig) -> int:
    """Print a topic's records; never produces (an undecodable record is shown with its
    error, not dead-lettered), and commits only with `--group`."""
    import json
    import time

    from pipeline.observe.records import show
    from workers.kafka.admin import missing_topics
    from workers.kafka.clients import make_consumer
    from workers.kafka.exceptions import MissingTopicsError

    topic = cfg.topics.name(args.topic) if args.topic in cfg.topics.ROLES else args.topic
    if missing_topics(cfg.kafka, [topic]):
        raise MissingTopicsError(
            f"topic {topic} not found at {cfg.kafka.bootstrap}; `rollout topics create` "
            "creates the run's topics, `rollout produce` fills rl.prompts",
            topics=[topic],
        )
    tokenizer = _tokenizer(args, cfg) if args.decode else None
    seen = shown = 0
    deadline = time.monotonic() + args.timeout
    consumer = make_consumer(cfg.kafka, topic, group_id=args.group, name="consume")
    try:
        while time.monotonic() < deadline and (args.limit is None or shown < args.limit):
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    seen += 1
                    row = show(
                        r.topic, r.partition, r.offset, r.value, r.headers, tokenizer=tokenizer
                    )
                    if _wanted(row, args) and (args.limit is None or shown < args.limit):
                        sys.stdout.write(json.dumps(row if args.records else _plain(row)) + "\n")
                        shown += 1
            if args.group:
                consumer.commit()
    finally:
        consumer.close()
    print(f"consumed {seen} records from {topic}, shown {shown}", file=sys.stderr)
    return 0


def _tokenizer(args: argparse.Namespace, cfg: RunConfig) -> Any:
    """The tokenizer `--decode` shows text with: `--tokenizer`, else the run's (the reward
    stage's, the agent loop's model, the trainer's model), from this config or else from the
    config `rollout up` saved in the run's directory (`runs/<run>/config.yaml` here)."""
    from pipeline.cli.common import checked_model_dir
    from pipeline.config import load_config

    where = args.tokenizer or _models_of(cfg)
    saved = Path("runs") / cfg.topics.run_name / "config.yaml"
    if not where and saved.is_file():
        where = _models_of(load_config(saved))
    if not where:
        raise ConfigError(
            "--decode needs a tokenizer: --tokenizer DIR (the policy's model), or run it where "
            f"`rollout up` keeps the run ({saved} is not here)"
        )
    directory = checked_model_dir(where, "--tokenizer" if args.tokenizer else "tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _models_of(cfg: RunConfig) -> str | None:
    return cfg.reward.tokenizer or cfg.agent_loop.model or cfg.trainer.model_dir or None


def _wanted(row: dict[str, Any], args: argparse.Namespace) -> bool:
    letter = row.get("dead_letter")
    if args.stage and (letter is None or letter["stage"] != args.stage):
        return False
    return not (args.cause and (letter is None or letter["cause"] != args.cause))


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A decoded event of an ordinary topic is printed alone (the event's own JSON); a dead
    letter or an undecodable record keeps the whole row, with its reason."""
    if "event" in row and "dead_letter" not in row:
        return dict(row["event"])
    return row


def cmd_data_arith(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.data.arithmetic import arithmetic_rows, write_rows

    if Path(args.out).suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"--out {args.out}: the name must end in .jsonl or .parquet")
    writable_dir(Path(args.out).parent, "--out")
    path = write_rows(
        arithmetic_rows(args.n, seed=args.seed, max_operand=args.max_operand), args.out
    )
    print(path)
    return 0


def cmd_model_init(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.harness.models.tiny import init_model

    if args.reward_model and args.preset in ("moe", "vl"):
        raise ConfigError(
            f"--reward-model: the {args.preset} preset is a causal LM only; use tiny or small"
        )
    if args.warm_start and (args.reward_model or args.preset == "vl"):
        raise ConfigError("--warm-start teaches a text policy: not with --reward-model or vl")
    warm_rows = _warm_rows(args.warm_start) if args.warm_start else None
    writable_dir(Path(args.out), "--out")
    out = init_model(
        args.out,
        preset=args.preset,
        seed=args.seed,
        reward_model=args.reward_model,
        template=args.template,
    )
    if warm_rows is not None:
        from transformers.utils import logging as hf_logging

        from pipeline.harness.recipe import DemoRecipe, warm_start

        hf_logging.disable_progress_bar()
        recipe = DemoRecipe(seed=args.seed)
        seconds = warm_start(out, warm_rows, recipe)
        print(
            f"warm start: {recipe.sft_steps} supervised steps on {len(warm_rows)} rows of "
            f"{args.warm_start} ({seconds:.0f}s)",
            file=sys.stderr,
        )
    print(out)
    return 0


def _warm_rows(dataset: str) -> list[dict[str, Any]]:
    """The rows of `dataset` a warm start learns from: each valid prompt that has a ground
    truth, as chat messages and the answer (in the gsm8k `#### answer` format the rule
    scorers read). None of them: one line, before the model is built."""
    from pipeline.data.datasets import RowError, read_rows, row_to_prompt

    rows = []
    for number, row in read_rows(dataset):
        try:
            event = row_to_prompt(row, number, uid_prefix="warm")
        except RowError:
            continue
        truth = event.reward_model.ground_truth
        if truth is None or any(not isinstance(m.content, str) for m in event.prompt):
            continue
        messages = [{"role": m.role, "content": m.content} for m in event.prompt]
        rows.append({"prompt": messages, "reward_model": {"ground_truth": str(truth)}})
    if not rows:
        raise ConfigError(
            f"--warm-start {dataset}: no row with a text prompt and reward_model.ground_truth"
        )
    return rows


def add_parsers(sub: Any) -> None:
    produce = sub.add_parser("produce", help="Produce a verl-format dataset to the prompts topic.")
    produce.add_argument("--dataset", required=True, help=".parquet, .jsonl or .json")
    produce.add_argument("--limit", type=at_least(0, int), help="Produce at most this many.")
    produce.add_argument(
        "--rate",
        type=at_least(0, float, strict=True),
        help="Prompts per second (default: as fast as possible).",
    )
    produce.add_argument(
        "--uid-prefix",
        help="Prefix of generated uids (default: the file's stem and a digest of its bytes).",
    )
    produce.add_argument(
        "--allow-unscorable",
        action="store_true",
        help="Send rows the run's reward stage cannot score (no ground truth for a rule "
        "scorer, an unknown data_source); they are dead-lettered after generation.",
    )
    produce.add_argument("--quiet", action="store_true", help="No progress bar.")
    produce.set_defaults(handler=cmd_produce)

    consume = sub.add_parser(
        "consume",
        help="Print a topic's records as JSON lines (dead letters with their reason); "
        "never writes to any topic.",
    )
    consume.add_argument(
        "--topic", default="prompts", help="A role (prompts, turns, dlq, …) or a topic name."
    )
    consume.add_argument(
        "--group", help="Consumer group (committed); default: none, from the start."
    )
    consume.add_argument("--limit", type=at_least(0, int), help="Print at most this many.")
    consume.add_argument(
        "--timeout", type=float, default=10.0, help="Stop after this many seconds."
    )
    consume.add_argument("--stage", help="Only dead letters from this stage (e.g. reward).")
    consume.add_argument("--cause", help="Only dead letters of this cause (e.g. json).")
    consume.add_argument(
        "--records",
        action="store_true",
        help="Every record as {topic, partition, offset, event|undecodable[, dead_letter]}.",
    )
    consume.add_argument(
        "--decode",
        action="store_true",
        help="Also show token arrays as text (prompt_text, response_text).",
    )
    consume.add_argument(
        "--tokenizer",
        help="With --decode: the model directory whose tokenizer decodes (default: the run's "
        "reward.tokenizer, agent_loop.model or trainer.model_dir).",
    )
    consume.set_defaults(handler=cmd_consume)

    data = sub.add_parser("data", help="Generate datasets.")
    dsub = data.add_subparsers(dest="action", required=True)
    arith = dsub.add_parser("arith", help="Arithmetic questions in gsm8k format.")
    arith.add_argument("--out", required=True, help=".jsonl or .parquet")
    arith.add_argument("--n", type=int, default=1000, help="Rows to write.")
    arith.add_argument("--seed", type=int, default=0, help="Random seed (same seed, same rows).")
    arith.add_argument("--max-operand", type=int, default=20, help="Largest operand of a question.")
    arith.set_defaults(handler=cmd_data_arith)

    model = sub.add_parser("model", help="The project's own tiny models.")
    msub = model.add_subparsers(dest="action", required=True)
    minit = msub.add_parser(
        "init", help="Write a randomly initialised Qwen2 (or Qwen3-MoE) model + tokenizer."
    )
    minit.add_argument("--out", required=True, help="Directory to write the model into.")
    minit.add_argument(
        "--preset",
        choices=["tiny", "small", "moe", "vl"],
        default="tiny",
        help="Model size (default: tiny); moe: a Qwen3-MoE, 4 layers of 8 experts, top-2.",
    )
    minit.add_argument("--seed", type=int, default=0, help="Seed of the random weights.")
    minit.add_argument(
        "--reward-model", action="store_true", help="A sequence-classification head."
    )
    minit.add_argument(
        "--template",
        choices=FAMILY_NAMES,
        default="hermes",
        help="Chat format: the family's special tokens, chat template and tool-call syntax "
        "(default: hermes, the project's own).",
    )
    minit.add_argument(
        "--warm-start",
        metavar="DATASET",
        help="Then a short supervised warm start on this dataset's questions and ground "
        "truths in the `#### answer` format (the demo's), so RL starts above zero reward.",
    )
    minit.set_defaults(handler=cmd_model_init)
