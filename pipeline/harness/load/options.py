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

from pipeline.cli.options import option
from pipeline.config import RunConfig
from pipeline.harness.local_run import knobs_of, local_run_config
from workers.kafka.config import KafkaConfig

__all__ = ["LoadOptions", "load_run_config"]


@dataclass
class LoadOptions:
    """A soak's options; those named as `local_run_config`'s knobs (`n`, `max_tokens`,
    `in_flight`, `train_batch_size`, `sync_every`, `max_staleness`) reach it by name."""

    minutes: float = option(10.0, "Minutes of load (default 10).")
    baseline_minute: float = option(
        2.0, "Memory growth and throughput are measured from this minute to the end."
    )
    sample_s: float = option(15.0, "Seconds between lag/memory samples.")
    replicas: int = option(2, "hf replicas.")
    agent_loop_workers: int = option(1, "Agent-loop worker processes.", flag="--workers")
    n: int = 4
    max_tokens: int = option(16, "Tokens per response.")
    in_flight: int = 64  # samples per agent-loop worker
    train_batch_size: int = 8
    sync_every: int = 2
    max_staleness: int = 8
    backlog: int | None = option(
        None, "Prompts kept waiting (default: half what the workers hold, at least 8).", type=int
    )
    memory_limit_pct: float = option(20.0, "Allowed RSS growth, percent.", flag="--memory-limit")
    ready_timeout_s: float = 600.0
    drain_s: float = 180.0
    model_dir: str | None = option(
        None, "Policy model directory (default: the tiny model).", flag="--model"
    )
    run_dir: str | None = option(None, "Where logs and the report go (default reports/load-*).")

    @property
    def baseline(self) -> float:
        """The minute growth and throughput are measured from; half the run if that is
        shorter than `baseline_minute`."""
        return self.baseline_minute if self.baseline_minute < self.minutes else self.minutes / 2


def load_run_config(
    opts: LoadOptions, kafka: KafkaConfig, prefix: str, model: str, run: Path
) -> RunConfig:
    # Admission bounds staleness at the source; replay and trainer keep every group past the
    # bound, so a slow trainer never turns the soak's samples into drops.
    return local_run_config(
        kafka,
        prefix,
        model,
        run,
        **knobs_of(opts),
        overrides={
            "agent_loop": {"sampling": {"ignore_eos": True}},
            "replay": {"stale_policy": "keep"},
            "trainer": {"stale_policy": "keep", "keep_checkpoints": 2},
        },
    )
