"""Chaos suite: the whole pipeline under process kills, stops and broker restarts, with
exactly-once accounting of every sample (`rollout chaos`, `make chaos`)."""
