"""One soak: the whole pipeline under the highest load it sustains, for a bounded time.

`run_load(kafka, LoadOptions(minutes=10))`:

1. a broker of its own unless ROLLOUT_KAFKA__BOOTSTRAP_SERVERS names one, topics under a
   fresh prefix, the tiny model, and the fast engine setting of `options.load_run_config`;
2. every stage its own process (`LocalPipeline`, metrics on), prompts offered by a
   `BacklogController` that keeps a bounded backlog on the prompts topic topped up;
3. the clock starts when the first trajectory is scored (`ready`); memory (RSS with
   children) of every process is taken then, at `baseline_minute`, at the end and every
   `sample_s` (with every consumer group's lag); throughput per stage is the change of the
   stages' counters from `baseline_minute` to the end;
4. after the end no more prompts are offered and the pipeline drains, so every prompt
   produced between `baseline_minute` and the end has its end-to-end latency
   (`probes.read_timestamps`: record CreateTimes, exact to the millisecond);
5. the run fails when a process died, a record was dead-lettered, a window prompt was never
   scored, a process logged an ERROR line or a traceback after `ready`, or a checked
   process grew by `memory_limit_pct` or more from the baseline to the end. Every stage
   process is checked; the broker's RSS is reported, not checked: it is not the pipeline's,
   and its heap is bounded by -Xmx.

The report (a dict; `figures.render` prints it) and `timeline.jsonl` go to the run directory.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.harness.bench.common import bench_broker, tiny_model
from pipeline.harness.load.figures import (
    BacklogController,
    latency_summary,
    memory_rows,
    stage_rates,
    stale_share,
)
from pipeline.harness.load.options import LoadOptions, load_run_config
from pipeline.harness.load.probes import counters, read_timestamps, tree_rss
from workers.kafka.config import KafkaConfig

__all__ = ["LoadOptions", "run_load"]

log = logging.getLogger("rollout.load")


def run_load(kafka: KafkaConfig, opts: LoadOptions) -> dict[str, Any]:
    from pipeline.topics import create_topics, delete_topics

    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = Path(opts.run_dir or f"reports/load-{stamp}").resolve()
    run.mkdir(parents=True, exist_ok=True)
    own_broker = "ROLLOUT_KAFKA__BOOTSTRAP_SERVERS" not in os.environ
    with tiny_model(opts.model_dir) as model, bench_broker(kafka) as kafka_cfg:
        prefix = f"load-{uuid.uuid4().hex[:6]}."
        cfg = load_run_config(opts, kafka_cfg, prefix, model, run)
        create_topics(cfg.kafka, cfg.topics)
        try:
            report = _Soak(
                cfg, opts, run, model, _broker_pid(kafka_cfg) if own_broker else None
            ).run()
        finally:
            delete_topics(cfg.kafka, cfg.topics)
    (run / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _broker_pid(kafka: KafkaConfig) -> int | None:
    from pipeline.broker.local import broker_status

    port = int(kafka.bootstrap.split(",")[0].rsplit(":", 1)[1])
    pid = broker_status(port)["pid"]
    return int(pid) if isinstance(pid, int) else None


class _Soak:
    def __init__(
        self, cfg: RunConfig, opts: LoadOptions, run: Path, model: str, broker_pid: int | None
    ) -> None:
        self.cfg, self.opts, self.run_dir, self.model = cfg, opts, run, model
        self.broker_pid = broker_pid
        held = opts.agent_loop_workers * opts.in_flight // opts.n
        self.controller = BacklogController(opts.backlog or max(held // 2, 8))
        self.problems: list[str] = []
        self.produced = 0
        self.memory: dict[str, dict[str, int]] = {"peak": {}}
        self.lag: list[dict[str, Any]] = []
        self.log_errors: dict[str, int] = {}
        self.log_offsets: dict[str, int] = {}

    def run(self) -> dict[str, Any]:
        from pipeline.data.producer import PromptProducer
        from pipeline.launch.local import LocalPipeline

        opts, topics = self.opts, self.cfg.topics
        with (
            LocalPipeline(
                self.cfg,
                self.run_dir,
                model_dir=self.model,
                replicas=opts.replicas,
                agent_loop_workers=opts.agent_loop_workers,
                metrics=True,
            ) as pipe,
            PromptProducer(self.cfg.kafka, topics) as producer,
            (self.run_dir / "timeline.jsonl").open("w") as timeline,
        ):
            self.pipe, self.producer, self.timeline = pipe, producer, timeline
            self.urls = {
                name: f"http://127.0.0.1:{port}/metrics"
                for name, port in pipe.metrics_ports.items()
            }
            launched = time.monotonic()
            window: dict[str, Any] | None = None
            ready = self._until_ready(launched)
            if ready is not None:
                window = self._soak(ready)
                if not self.problems:
                    self._drain()
            self._log_errors()  # before stop(): shutting down logs what it likes
        return self._report(window, ready, launched)

    # --- phases -----------------------------------------------------------------------

    def _alive(self) -> bool:
        from pipeline.launch.local import StageExitedError

        try:
            self.pipe.check()
        except StageExitedError as exc:
            self.problems.append(str(exc).splitlines()[0])
            return False
        return True

    def _tick(self) -> bool:
        """Offer prompts; False when a process died."""
        if not self._alive():
            return False
        prompts = self.cfg.topics.name("prompts")
        taken = counters(u for n, u in self.urls.items() if n.startswith("agent-loop"))
        consumed = int(sum(v for (_, t, d), v in taken.items() if t == prompts and d == "consumed"))
        self._offer(self.controller.to_send(self.produced, consumed))
        return True

    def _offer(self, count: int) -> None:
        if count <= 0:
            return
        from pipeline.data.arithmetic import arithmetic_rows

        # uid arith-train-<seed>-<index>: a fresh seed per top-up keeps every uid unique.
        self.producer.produce_rows(arithmetic_rows(count, seed=self.produced))
        self.produced += count

    def _until_ready(self, launched: float) -> float | None:
        scored = self.cfg.topics.name("scored")
        while time.monotonic() - launched < self.opts.ready_timeout_s:
            if not self._tick():
                return None
            reward = counters([self.urls["reward"]])
            if reward.get(("reward", scored, "produced"), 0) > 0:
                ready = time.monotonic()
                self._sample(ready, ready, "start")
                self.log_offsets = {p.name: _size(p.log_path) for p in self.pipe.processes}
                return ready
            time.sleep(0.5)
        self.problems.append(f"no trajectory scored within {self.opts.ready_timeout_s:.0f} s")
        return None

    def _soak(self, ready: float) -> dict[str, Any]:
        opts = self.opts
        baseline_s = opts.baseline * 60
        end_s = opts.minutes * 60
        baseline: dict[str, Any] | None = None
        next_sample = ready + opts.sample_s
        while (now := time.monotonic()) - ready < end_s:
            if not self._tick():
                break
            if baseline is None and now - ready >= baseline_s:
                baseline = self._sample(ready, now, "baseline")
                next_sample = now + opts.sample_s
            elif now >= next_sample:
                self._sample(ready, now, None)
                next_sample = now + opts.sample_s
            time.sleep(0.5)
        end = self._sample(ready, time.monotonic(), "end")
        return {"baseline": baseline or end, "end": end}

    def _drain(self) -> None:
        """No more prompts: wait until every produced prompt's samples are scored."""
        scored = self.cfg.topics.name("scored")
        deadline = time.monotonic() + self.opts.drain_s
        while time.monotonic() < deadline:
            done = counters([self.urls["reward"]]).get(("reward", scored, "produced"), 0)
            if done >= self.produced * self.opts.n or not self._alive():
                return
            time.sleep(1.0)

    def _sample(self, ready: float, now: float, moment: str | None) -> dict[str, Any]:
        from pipeline.observe.status import consumer_lag

        roots = {p.name: p.proc.pid for p in self.pipe.processes if p.proc is not None}
        if self.broker_pid is not None:
            roots["broker"] = self.broker_pid
        rss = tree_rss(roots)
        peak = self.memory["peak"]
        for name, value in rss.items():
            peak[name] = max(peak.get(name, 0), value)
        if moment is not None:
            self.memory[moment] = rss
        prefix = self.cfg.topics.prefix
        lag = {
            group.removeprefix(prefix): {
                t.removeprefix(prefix): row["lag"] for t, row in by.items()
            }
            for group, by in consumer_lag(self.cfg.kafka, self.cfg.topics).items()
        }
        by_role = {
            (s, t.removeprefix(prefix), d): v
            for (s, t, d), v in counters(self.urls.values()).items()
        }
        sample = {
            "t_s": round(now - ready, 1),
            "wall": time.time(),
            "groups": lag,
            "rss": rss,
            "counters": by_role,
            "produced": self.produced,
        }
        self.lag.append({"t_s": sample["t_s"], "groups": lag})
        self.timeline.write(json.dumps(sample | {"counters": _flat(sample["counters"])}) + "\n")
        self.timeline.flush()
        return sample

    def _log_errors(self) -> None:
        """Error lines in each process's log from `ready` on (start-up, when the fresh
        broker's group coordinator is not there yet, logs a few that are not ours)."""
        counts = {}
        for proc in self.pipe.processes:
            if proc.name not in self.log_offsets:
                continue
            with proc.log_path.open("rb") as fh:
                fh.seek(self.log_offsets[proc.name])
                text = fh.read().decode(errors="replace")
            counts[proc.name] = sum(
                1 for line in text.splitlines() if " ERROR " in line or line.startswith("Traceback")
            )
        self.log_errors = {k: v for k, v in counts.items() if v}

    # --- report -----------------------------------------------------------------------

    def _report(
        self, window: dict[str, Any] | None, ready: float | None, launched: float
    ) -> dict[str, Any]:
        opts = self.opts
        report: dict[str, Any] = {
            "minutes": opts.minutes,
            "baseline_minute": opts.baseline,
            "ready_s": round(ready - launched, 1) if ready else None,
            "backlog_target": self.controller.target,
            "prompts_produced": self.produced,
            "settings": asdict(opts),
            "run_dir": str(self.run_dir),
            "lag": self.lag,
            "memory_limit_pct": opts.memory_limit_pct,
            "throughput": {},
            "prompts_per_s": 0.0,
            "trajectories_per_s": 0.0,
            "log_errors": self.log_errors,
            "latency": latency_summary([]) | {"unscored": 0},
        }
        if window is not None:
            first, last = window["baseline"], window["end"]
            seconds = last["wall"] - first["wall"]
            rates = stage_rates(first["counters"], last["counters"], seconds)
            report["throughput"] = rates
            report["prompts_per_s"] = rates.get("agent-loop", {}).get("consumed prompts", 0.0)
            report["trajectories_per_s"] = rates.get("reward", {}).get("produced scored", 0.0)
            report["latency"] = self._latency(first["wall"], last["wall"])
            dead = sum(
                v for (_, t, d), v in last["counters"].items() if (t, d) == ("dlq", "produced")
            )
            if dead:
                self.problems.append(f"{dead:.0f} records were dead-lettered")
            if report["latency"]["unscored"]:
                self.problems.append(
                    f"{report['latency']['unscored']} trajectories of prompts "
                    "produced under load were never scored"
                )
        report |= self._staleness()
        if report["stale_share"]:
            self.problems.append(
                f"{100 * report['stale_share']:.1f}% of the trained groups were "
                f"past max_staleness {opts.max_staleness}"
            )
        rows = memory_rows(self.memory, [p.name for p in self.pipe.processes]) if ready else []
        report["memory"] = [
            asdict(r) | {"growth_pct": round(r.growth_pct, 1), "ok": r.ok(opts.memory_limit_pct)}
            for r in rows
        ]
        self.problems.extend(
            f"{r.process} grew {r.growth_pct:.1f}% (limit {opts.memory_limit_pct}%)"
            for r in rows
            if not r.ok(opts.memory_limit_pct)
        )
        self.problems.extend(
            f"{name}: {count} error lines in its log under load"
            for name, count in report["log_errors"].items()
        )
        report["problems"] = self.problems
        report["ok"] = not self.problems
        return report

    def _staleness(self) -> dict[str, Any]:
        from workers.trainer.steplog import effective_steps

        trainer = self.cfg.trainer
        path = Path(trainer.metrics_file or Path(trainer.checkpoint_dir) / "metrics.jsonl")
        steps = effective_steps(path).values() if path.exists() else []
        return stale_share(steps, self.opts.max_staleness)

    def _latency(self, start_wall: float, end_wall: float) -> dict[str, Any]:
        topics = self.cfg.topics
        prompts = read_timestamps(self.cfg.kafka, topics.name("prompts"))
        scored = read_timestamps(self.cfg.kafka, topics.name("scored"), by_header=True)
        window = {uid for uid, t in prompts.items() if start_wall <= t <= end_wall}
        latencies = [
            t - prompts[tid.rsplit("/", 1)[0]]
            for tid, t in scored.items()
            if tid.rsplit("/", 1)[0] in window
        ]
        return latency_summary(latencies) | {"unscored": len(window) * self.opts.n - len(latencies)}


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _flat(values: dict[tuple[str, str, str], float]) -> dict[str, float]:
    return {" ".join(key): value for key, value in values.items()}
