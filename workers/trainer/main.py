"""`rollout train` (one process): how the trainer stage starts, runs and stops in a process.

`run(kafka, topics, config)` installs the stop signals (Ctrl-C while torch imports and the
model loads ends the command at once; once the trainer has work in hand it stops cleanly:
checkpoint, publish, result) and runs the trainer until it is stopped, reaches `max_steps` or
idles past `idle_timeout_s`; its `TrainerResult`. The sharded trainer (`trainer.nproc` > 1,
one process a rank) starts from `workers.trainer.sharded.run_sharded_trainer` under torchrun.
"""

from __future__ import annotations

from typing import Any

from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.stopping import StopSignal
from workers.trainer.config import TrainerConfig
from workers.trainer.trainer import TrainerResult, run_trainer
from workers.weights.config import WeightsConfig

__all__ = ["run"]


def run(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    config: TrainerConfig,
    *,
    weights: WeightsConfig | None = None,
    metrics: Any = None,
    stop: StopSignal | None = None,
) -> TrainerResult:
    """Run the one-process trainer as a process does (module docstring). `stop`: the signals
    installed already (before the heavy imports), else installed here."""
    stop = stop or StopSignal(graceful=False).install()
    return run_trainer(kafka, topics, config, stop, metrics=metrics, transfer=weights)
