"""The reward stage: `rl.turns` → assembled, scored trajectories on `rl.scored`.

Light on import (config only); the stage lives in `workers.reward.app`, the entry point
in `workers.reward.main.run_worker`, the benchmark in `pipeline.harness.bench.reward`.
"""

from workers.reward.config import RewardConfig

__all__ = ["RewardConfig"]
