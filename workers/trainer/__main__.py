"""`python -m workers.trainer --config stage.yaml`: the trainer without the `rollout` CLI.

The YAML file holds `kafka`, `topics` and `trainer` sections (each optional; the models'
defaults apply). `--bootstrap` and `--prefix` override the file. SIGTERM or Ctrl-C stops the
trainer cleanly (final checkpoint + PolicyVersion). Exit status 2 for a bad config, 1 for a
trainer error, 0 otherwise; the last line on stdout is the run's result as JSON.
With `trainer.nproc > 1` (or under torchrun) it runs sharded: see `workers.trainer.sharded`.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.errors import RolloutError
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.trainer.config import TrainerConfig


class StageFile(BaseModel):
    """The sections of a trainer's config file."""

    model_config = ConfigDict(extra="forbid")

    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.trainer", description=__doc__)
    parser.add_argument("--config", help="YAML with kafka/topics/trainer sections.")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers.")
    parser.add_argument("--prefix", help="Topic prefix (topics.prefix).")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    data = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    data = data or {}
    if args.bootstrap:
        data.setdefault("kafka", {})["bootstrap_servers"] = args.bootstrap
    if args.prefix:
        data.setdefault("topics", {})["prefix"] = args.prefix
    try:
        stage = StageFile.model_validate(data)
    except ValidationError as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    from workers.trainer.launch import launched_by_torchrun, relaunch

    if stage.trainer.nproc > 1 and not launched_by_torchrun():
        return relaunch(
            stage.trainer.nproc, "workers.trainer", sys.argv[1:] if argv is None else argv
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if launched_by_torchrun():
            from workers.trainer.sharded import run_sharded_trainer

            result = run_sharded_trainer(stage.kafka, stage.topics, stage.trainer, stop)
        else:
            from workers.trainer.trainer import run_trainer

            result = run_trainer(stage.kafka, stage.topics, stage.trainer, stop)
    except RolloutError as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 1
    if result is not None:  # ranks > 0 have nothing to report
        print(json.dumps(asdict(result)))
    if launched_by_torchrun():
        from workers.trainer.sharded import leave_rank

        leave_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
