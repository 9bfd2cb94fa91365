"""The replay-buffer stage: scored trajectories → training groups, staleness-aware.

Light on import (config only); the stage lives in `workers.replay.app`, the per-batch
logic in `workers.replay.batch`, the entry point in `workers.replay.main.run_worker`.
"""

from workers.replay.config import ReplayConfig

__all__ = ["ReplayConfig"]
