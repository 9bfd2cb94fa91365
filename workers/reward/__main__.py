"""`python -m workers.reward --config stage.yaml`: the reward stage without the `rollout` CLI.

The YAML file holds `kafka`, `topics` and `reward` sections (each optional; the models'
defaults apply). `--bootstrap` and `--prefix` override the file. Exit status 2 for a bad
config, 1 for a stage error.
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
from workers.reward.config import RewardConfig


class StageFile(BaseModel):
    """The sections of a reward stage's config file."""

    model_config = ConfigDict(extra="forbid")

    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.reward", description=__doc__)
    parser.add_argument("--config", help="YAML with kafka/topics/reward sections.")
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
    from workers.reward.worker import run_worker

    try:
        return run_worker(stage.kafka, stage.topics, stage.reward)
    except RolloutError as exc:
        print(f"reward: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
