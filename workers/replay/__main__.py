"""`python -m workers.replay --config stage.yaml`: the replay stage without the `rollout` CLI.

The YAML file holds `kafka`, `topics` and `replay` sections (each optional; the models'
defaults apply). `--bootstrap`, `--prefix` and `--n` override the file. Exit status 2 for a
bad config, 1 for a stage error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.errors import RolloutError
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.replay.config import ReplayConfig


class StageFile(BaseModel):
    """The sections of a replay stage's config file."""

    model_config = ConfigDict(extra="forbid")

    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.replay", description=__doc__)
    parser.add_argument("--config", help="YAML with kafka/topics/replay sections.")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers.")
    parser.add_argument("--prefix", help="Topic prefix (topics.prefix).")
    parser.add_argument("--n", type=int, help="Samples per prompt (replay.n).")
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
    if args.n is not None:
        data.setdefault("replay", {})["n"] = args.n
    try:
        stage = StageFile.model_validate(data)
    except ValidationError as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    from workers.replay.worker import run_worker

    try:
        return run_worker(stage.kafka, stage.topics, stage.replay)
    except RolloutError as exc:
        print(f"replay: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
