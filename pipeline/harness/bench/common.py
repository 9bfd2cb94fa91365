"""What several benchmarks share: a broker to run against, the tiny model, a run's prompts on
its own topics, watching its pipeline and reading its trainer's steps, and the rounds.

A benchmark compares sides (a baseline and the thing measured) in the same run: `interleaved`
runs them in turn each round, `paired_ratio` reports the median of the per-round ratios with
every round's and their spread, `rates` a side's best with every round's and the spread.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.kafka.config import KafkaConfig
from workers.ports import free_port

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.launch.local import LocalPipeline

__all__ = [
    "bench_broker",
    "cpu_seconds",
    "interleaved",
    "paired_ratio",
    "per_core_rate",
    "prompted_run",
    "rates",
    "tiny_model",
    "trainer_steps",
    "watch_until",
]


@contextmanager
def bench_broker(kafka: KafkaConfig) -> Iterator[KafkaConfig]:
    """The configured cluster if the run names one (`--bootstrap`, `kafka.bootstrap_servers`
    in the config or ROLLOUT_KAFKA__BOOTSTRAP_SERVERS), else a local broker on a free port
    with a throw-away data directory, stopped afterwards."""
    if "bootstrap_servers" in kafka.model_fields_set:
        from workers.kafka.clients import make_admin

        make_admin(kafka).close()  # unreachable: one line now, not after the replicas started
        yield kafka
        return
    from pipeline.broker.local import start_broker, stop_broker

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rollout-bench-kafka-") as data:
        state = start_broker(port, Path(data), quiet=True)
        try:
            yield kafka.model_copy(update={"bootstrap_servers": [state.bootstrap]})
        finally:
            stop_broker(port)


@contextmanager
def tiny_model(model_dir: str | None = None) -> Iterator[str]:
    """`model_dir` if given, else the tiny model built into a temporary directory."""
    if model_dir:
        yield model_dir
        return
    from pipeline.harness.models.tiny import init_model

    with tempfile.TemporaryDirectory(prefix="rollout-bench-model-") as tmp:
        yield str(init_model(Path(tmp) / "tiny", preset="tiny", seed=0))


def prompted_run(
    kafka: KafkaConfig,
    model: str,
    run_dir: Path,
    tag: str,
    *,
    prompts: int,
    seed: int,
    overrides: dict[str, Any] | None = None,
    **knobs: Any,
) -> RunConfig:
    """The config of one local run of a benchmark, its topics created, `prompts` arithmetic
    prompts (of `seed`) on them.

    The topics are the run's own, under a fresh prefix `<tag>-<6 hex>.`; `knobs` and
    `overrides` are `local_run_config`'s; every response runs to `max_tokens` (`ignore_eos`),
    so each side of a benchmark does the same work.
    """
    import uuid

    from pipeline.data.arithmetic import arithmetic_rows
    from pipeline.data.producer import PromptProducer
    from pipeline.harness.local_run import local_run_config, merge
    from pipeline.topics import create_topics

    prefix = f"{tag}-{uuid.uuid4().hex[:6]}."
    fixed_length = {"agent_loop": {"sampling": {"ignore_eos": True}}}
    cfg = local_run_config(
        kafka, prefix, model, run_dir, overrides=merge(fixed_length, overrides or {}), **knobs
    )
    create_topics(cfg.kafka, cfg.topics)
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(prompts, seed=seed), uid_prefix=prefix)
    return cfg


def trainer_steps(cfg: RunConfig) -> list[dict[str, Any]]:
    """The `step` records of the run's trainer log, in order (none yet: [])."""
    import json

    metrics = Path(cfg.trainer.metrics_path)
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "step"]


def watch_until(pipe: LocalPipeline, done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Watch `pipe` (a stage that died raises) every half second until `done()`;
    TimeoutError(`what`) once `timeout_s` passed without it."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        pipe.check()
        time.sleep(0.5)


def interleaved(sides: dict[str, Callable[[int], float]], rounds: int) -> dict[str, list[float]]:
    """Each side's figure per round, the sides run one after another within each round, so
    a slow minute on a shared machine lands on every side alike; the order turns round every
    other round (a, b, b, a, a, b, ...), so a load that rises or falls across a round does not
    favour the side that runs first. `sides[name](round)` returns the round's figure (a rate:
    higher is better)."""
    figures: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        order = list(sides.items())
        for name, side in order if r % 2 == 0 else reversed(order):
            figures[name].append(side(r))
    return figures


def paired_ratio(num: list[float], den: list[float], prefix: str = "ratio") -> dict[str, Any]:
    """`num / den` of each round (the two measured minutes apart, under the same load), their
    median as the figure, every round's value and the spread (max - min) / median."""
    ratios = [a / b for a, b in zip(num, den, strict=True) if b > 0]
    mid = statistics.median(ratios) if ratios else 0.0
    return {
        prefix: round(mid, 3),
        f"{prefix}_runs": [round(x, 3) for x in ratios],
        f"{prefix}_spread": round((max(ratios) - min(ratios)) / mid, 3) if mid else None,
    }


def rates(name: str, values: list[float], digits: int = 1) -> dict[str, Any]:
    """The best of a side's rates, every round's, and the spread (max - min) / best."""
    best = max(values)
    return {
        name: round(best, digits),
        f"{name}_runs": [round(v, digits) for v in values],
        f"{name}_spread": round((best - min(values)) / best, 3) if best else None,
    }


# CPU seconds of a process, from the kernel's accounting: what a bench charges a component.
# Wall-clock rates on a shared machine swing with everyone else's load; the CPU a process used
# for a piece of work much less, so benches report it beside their rates. Linux only: user +
# system time of every thread, from /proc/<pid>/stat (fields 14 and 15, in clock ticks: 10 ms
# steps, so a short window of another process can read 0), or, for the calling process, the
# kernel's per-process CPU clock (time.process_time: nanoseconds, where os.times() has ticks
# too). psutil reads the same file; no dependency needed.
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of `pid` (all its threads, not its children); of this
    process if None. `ProcessLookupError` if `pid` is gone."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def per_core_rate(units: float, cpu_s: float) -> float:
    """Units per CPU-second: how many one core of this component sustains (0 if no CPU)."""
    return units / cpu_s if cpu_s > 0 else 0.0
