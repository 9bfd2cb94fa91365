"""What one soak runs: its options, and the run config they make (a fast engine setting).

The engine is fast on purpose (16 tokens, `ignore_eos`, the tiny model, one torch thread per
replica): the soak is about the pipeline around it. Admission is sized so the trainer does
not hold generation back: `(max_staleness + 1) × train_batch_size` groups must exceed what
generation holds (`in_flight / n` per worker) plus the groups trained between two published
versions (`sync_every × train_batch_size`); the replay stage and the trainer then keep every
group (no staleness drops). Two checkpoints are kept, so disk stays bounded over the soak.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import RunConfig
from pipeline.local_run import local_run_config
from workers.kafka.config import KafkaConfig

__all__ = ["LoadOptions", "load_run_config"]


@dataclass
class LoadOptions:
    minutes: float = 10.0
    baseline_minute: float = 2.0  # memory growth and throughput are measured from here
    sample_s: float = 15.0
    replicas: int = 2
    agent_loop_workers: int = 1
    n: int = 4
    max_tokens: int = 16
    in_flight: int = 64  # samples per agent-loop worker
    train_batch_size: int = 8
    sync_every: int = 2
    max_staleness: int = 8
    backlog: int | None = None  # prompts waiting; default: half what the workers hold, ≥ 8
    memory_limit_pct: float = 20.0
    ready_timeout_s: float = 600.0
    drain_s: float = 180.0
    model_dir: str | None = None
    run_dir: str | None = None

    @property
    def baseline(self) -> float:
        """The minute growth and throughput are measured from; half the run if that is
        shorter than `baseline_minute`."""
        return self.baseline_minute if self.baseline_minute < self.minutes else self.minutes / 2


def load_run_config(
    opts: LoadOptions, kafka: KafkaConfig, prefix: str, model: str, run: Path
) -> RunConfig:
    # Admission bounds staleness at the source; replay and trainer keep every group, so a
    # slow trainer never turns the soak's samples into drops.
    return local_run_config(
        kafka,
        prefix,
        model,
        run,
        n=opts.n,
        train_batch_size=opts.train_batch_size,
        max_tokens=opts.max_tokens,
        max_staleness=opts.max_staleness,
        in_flight=opts.in_flight,
        sync_every=opts.sync_every,
        overrides={
            "agent_loop": {"sampling": {"ignore_eos": True}},
            "replay": {"max_staleness": None},
            "trainer": {"max_staleness": None, "keep_checkpoints": 2},
        },
    )
