"""Soak test: the whole pipeline at the highest load it sustains for a bounded time, with
throughput per stage, end-to-end latency, consumer lag and memory growth
(`rollout load`, `make load`)."""
