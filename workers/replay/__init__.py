"""The replay-buffer stage: scored trajectories → training groups, staleness-aware."""
