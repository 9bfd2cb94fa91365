"""The off-policy trainer stage and the public `TrajectoryConsumer`.

Light on import (no torch): `TrainerConfig` and the consumer load without it; the training
loop lives in `workers.trainer.trainer` (`run_trainer`), the loss in `workers.trainer.loss`;
the replicas' weight-sync controller beside them, in `workers.weights.sync`.
"""

from workers.trainer.batching import TrajectoryBatch, grpo_advantages
from workers.trainer.config import TrainerConfig
from workers.trainer.consumer import Item, TrajectoryConsumer

__all__ = ["Item", "TrainerConfig", "TrajectoryBatch", "TrajectoryConsumer", "grpo_advantages"]
