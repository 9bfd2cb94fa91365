"""Pieces of benchmarks that are no `rollout bench` command of their own (every module
directly under `pipeline/harness/bench/` is one): the CPU split, the agent-loop bench's arithmetic
and its helper processes."""
