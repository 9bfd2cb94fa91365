"""The settings of one local run of the whole pipeline, in one place.

Benchmarks, the chaos suite and the soak all run every stage on one machine over topics of
their own; they differ in a few knobs (samples per prompt, batch, staleness bound, response
length). `local_run_config` writes the shared part once: consumer groups and app ids under
the run's topic prefix, the tiny model for every stage, short commit intervals and batch
waits (a local run is small, so waiting for full batches only adds latency), the trainer on
one CPU thread. `overrides` is merged into it section by section (nested mappings merge,
anything else replaces). `knobs_of` reads the knobs off a run's options dataclass.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, load_config
from workers.kafka.config import KafkaConfig

__all__ = ["knobs_of", "local_run_config", "merge"]


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in: nested mappings merge, anything else replaces."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def local_run_config(
    kafka: KafkaConfig,
    prefix: str,
    model: str | Path,
    run_dir: Path,
    *,
    n: int,
    train_batch_size: int,
    max_tokens: int,
    max_staleness: int | None,
    in_flight: int = 64,
    sync_every: int = 1,
    overrides: dict[str, Any] | None = None,
) -> RunConfig:
    """A validated `RunConfig` for a local run (secrets stay out: they travel by environment)."""
    model = str(model)
    settings: dict[str, Any] = {
        "kafka": kafka.model_dump(mode="json") | {"sasl_password": None, "ssl_password": None},
        "topics": {"prefix": prefix},
        "agent_loop": {
            "group_id": f"{prefix}agent-loop",
            "model": model,
            "n": n,
            "max_samples_in_flight": in_flight,
            "commit_interval_s": 0.5,
            "sampling": {"max_tokens": max_tokens, "temperature": 1.0},
            "llm": {"health_interval_s": 1.0},
        },
        "reward": {
            "group_id": f"{prefix}reward",
            "tokenizer": model,
            "batch_within_s": 0.05,
            "commit_interval_s": 0.5,
        },
        "replay": {
            "group_id": f"{prefix}replay",
            "n": n,
            "batch_within_s": 0.05,
            "commit_interval_s": 0.5,
        },
        "trainer": {
            "model_dir": model,
            "checkpoint_dir": str(run_dir / "ckpt"),
            "group_id": f"{prefix}trainer",
            "train_batch_size": train_batch_size,
            "sync_every": sync_every,
            "max_staleness": max_staleness,
            "torch_threads": 1,
            "lr": 1e-5,
        },
    }
    return load_config(None, merge(settings, overrides or {}))


def knobs_of(opts: Any) -> dict[str, Any]:
    """The fields of the dataclass `opts` that are knobs of `local_run_config` (its keywords
    but `overrides`) by name, to pass on as they are."""
    knobs = {
        name
        for name, param in inspect.signature(local_run_config).parameters.items()
        if param.kind is param.KEYWORD_ONLY and name != "overrides"
    }
    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name in knobs}
