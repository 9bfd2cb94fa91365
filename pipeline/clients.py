"""The pipeline's public clients, side by side: prompts in, trajectories out.

    from pipeline.clients import PromptProducer, TrajectoryConsumer

    with PromptProducer(kafka, topics) as producer:        # rows → rl.prompts
        producer.produce_rows(rows)
    with TrajectoryConsumer(kafka, topics, topic="replay", group_id="my-trainer") as source:
        for batch in source.batches(8):                     # rl.replay → padded torch batches
            ...
            source.commit()
    with PolicyPublisher.from_config(cfg) as publisher:    # your weights → replicas, rl.policy
        publisher.publish(model, version)

- `PromptProducer` (`pipeline.data.producer`): datasets or any iterable of rows → `rl.prompts`,
  idempotent and acknowledged (what `rollout produce` runs).
- `TrajectoryConsumer` (`workers.trainer.consumer`): `rl.replay` or `rl.scored` → typed events
  or padded batches, with positions that resume exactly (what the trainer reads with).
- `PolicyPublisher` (`workers.weights.publish`): a trainer of your own's new weights → the
  replicas (by checkpoint or broadcast, as the run's `weights.mode`), its version →
  `rl.policy`, so the replicas and the staleness gate follow it.

Their code stays beside what runs it (the CLI, the trainer); this is the place to import them
from. None loads torch on import.
"""

from __future__ import annotations

from pipeline.data.producer import ProduceReport, PromptProducer
from workers.trainer.consumer import TrajectoryConsumer
from workers.weights.publish import PolicyPublisher

__all__ = ["PolicyPublisher", "ProduceReport", "PromptProducer", "TrajectoryConsumer"]
