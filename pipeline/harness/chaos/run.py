"""One chaos run: the whole pipeline, faults at random moments, then exactly-once accounting.

`run_chaos(ChaosOptions(...))`:

1. a broker of its own (so it may restart it) unless `bootstrap` names one, or with
   `brokers=3` a cluster of its own (`pipeline.harness.chaos.cluster`: topics replicated 3 with
   `min.insync.replicas` 2, and the broker faults), topics under a fresh prefix, the tiny
   policy model;
2. `samples / n` prompts (n samples each) produced up front;
3. every stage as its own process (`LocalPipeline`, 2 agent-loop workers by default), with
   this driver as their supervisor: a process that exits on its own (a stage that lost the
   broker exits on purpose, so nothing half-done is committed) is started again, as
   systemd or Kubernetes would;
4. the faults of `faults.schedule`, one at a time, as the share of samples scored
   passes each trigger (the share scored: it moves smoothly; training comes in steps), each
   once the trainer has published a step since the last (the pipeline recovered): progress,
   not seconds, so the schedule fits a fast machine and a slow one. A fault and its recovery
   still take seconds (a SIGSTOP outlasts the session timeout, a trainer reloads its
   model), so on a fast machine faults can still be pending at `topup_share`. A broker fault
   runs in a thread until the cluster is whole again, while the supervisor and the progress
   watch go on; the next fault waits for it. Each stage's progress (its output topics' end
   offsets, `ProgressWatch`) is sampled throughout, and each broker fault's report has the
   longest stall of every stage around it. On a fast machine faults can still be pending at
   `topup_share`: the run then
   grows by half its samples (at most `max_topups` times) and the faults left fire as soon
   as the pipeline has recovered. A fault still waiting when `last_fault_share` is scored
   fails the run at once, before any drain;
5. drain until every sample is accounted for (or `timeout_s`), stop the pipeline cleanly,
   and account (`accounting.account`) from the trainer's step log and the stale and
   dead-letter topics.

The trainer takes one group per step, so the last groups never wait for a batch to fill.
Returns a report dict with the accounting table; `ok` is `lost == 0 and duplicated == 0`,
every fault fired, and at most `max_stale_share` of the samples dropped as stale (the
admission gate bounds staleness under faults too).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.cli.options import option
from pipeline.config import RunConfig
from pipeline.harness.chaos.accounting import Accounting, account, expected_ids
from pipeline.harness.chaos.cluster import (
    BrokerFaultThread,
    ChaosCluster,
    ProgressWatch,
    broker_report,
    longest_stalls,
    stalls,
)
from pipeline.harness.chaos.faults import DEFAULT_FAULTS, OwnBroker, inject, schedule
from pipeline.harness.local_run import local_run_config, merge
from workers.kafka.config import KafkaConfig

__all__ = ["ChaosOptions", "run_chaos"]

log = logging.getLogger("rollout.chaos")


@dataclass
class ChaosOptions:
    samples: int = option(2000, "Samples (prompts × n).")
    n: int = option(4, "Samples per prompt.")
    agent_loop_workers: int = option(2, "Agent-loop worker processes.", flag="--workers")
    replicas: int = option(2, "hf replicas.")
    faults: tuple[str, ...] = DEFAULT_FAULTS
    seed: int = option(0, "Picks the faults' order and moments.")
    timeout_s: float = option(1800.0, "Give up after (s).", flag="--timeout")
    stop_s: float = 16.0  # SIGSTOP length: longer than the 10 s consumer session timeout
    max_tokens: int = 32  # long enough a run for every fault to land while data moves
    max_staleness: int = 32  # one group a step: a version per group, so keep the bound loose
    # The admission gate runs this many versions inside the bound the replay stage and the
    # trainer drop at. With one group a step, a group admitted late by the gate (the count
    # it reads is up to a second old; a SIGSTOPped worker's prompts resume late) is a version
    # late per group; with a real batch of 64 groups the same slack is a fraction of one.
    admission_margin: int = 8
    # Every fault must have fired by this share of samples scored, or the run fails at once.
    last_fault_share: float = 0.9
    # Faults still pending at this share scored (a fast machine outran them: a fault and the
    # recovery the next waits for take seconds, not a share) add `samples // 2` samples, at
    # most `max_topups` times, and the faults left fire as soon as the pipeline recovers.
    topup_share: float = 0.75
    max_topups: int = 2
    max_stale_share: float = option(
        0.05, "Fail when more of the samples than this are dropped as stale."
    )
    # "scored": faults fire as the share of samples scored passes their triggers; "generating":
    # each fires as soon as the replicas are generating (a short run finishes in one step).
    trigger: str = "scored"
    bootstrap: str | None = option(
        None, "Use this broker (no broker fault).", flag="--bootstrap-existing", dest="existing"
    )
    brokers: int = option(
        1, "The run's own Kafka: 1 broker, or a cluster of 3 with the broker faults."
    )
    broker_down_s: float = 10.0  # a SIGKILLed broker is started again after this
    broker_stop_s: float = 16.0  # SIGSTOP of a broker: past its 6 s and the stages' 10 s
    stall_window_s: float = 30.0  # a stall that overlaps a broker fault or this after it
    run_dir: str | None = option(None, "Keep the run here (default: a temporary directory).")
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def chaos_config(
    opts: ChaosOptions, bootstrap: str, prefix: str, model: Path, run: Path
) -> RunConfig:
    # One group a step, so the last groups never wait for a batch to fill.
    return local_run_config(
        KafkaConfig(bootstrap_servers=bootstrap),
        prefix,
        model,
        run,
        n=opts.n,
        train_batch_size=1,
        max_tokens=opts.max_tokens,
        max_staleness=opts.max_staleness,
        in_flight=32,
        overrides=merge(
            {
                "reward": {"session_timeout_s": 10},
                "trainer": {"lr": 1e-4, "keep_checkpoints": 2},
                "agent_loop": {"admission": {"margin": opts.admission_margin}},
            },
            opts.extra,
        ),
    )


def _read_topic(kafka: KafkaConfig, topic: str) -> list[Any]:
    """Every record on `topic` now, from the beginning (no consumer group)."""
    from kafka import TopicPartition

    from workers.kafka.clients import make_consumer

    consumer = make_consumer(kafka, group_id=None, name="chaos-audit")
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records: list[Any] = []
        deadline = time.monotonic() + 120
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} took over 120 s")
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def _generating(urls: list[str]) -> int:
    """Requests running or waiting on the replicas now (their `/info`)."""
    import json
    import urllib.request

    total = 0
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/info", timeout=1.0) as resp:
                info = json.loads(resp.read())
            total += int(info.get("running", 0)) + int(info.get("waiting", 0))
        except (OSError, ValueError):
            continue
    return total


def audit(cfg: RunConfig, expected: set[str], upto: int | None = None) -> Accounting:
    """`_audit`, asked again for up to two minutes while a broker is down or frozen (a new
    client's bootstrap can land on a SIGSTOPped broker and give up after 5 s)."""
    from kafka.errors import KafkaError

    from workers.kafka.exceptions import KafkaUnavailableError

    deadline = time.monotonic() + 120
    while True:
        try:
            return _audit(cfg, expected, upto)
        except (KafkaError, KafkaUnavailableError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise
            log.info("chaos: audit failed (%r); again", exc)
            time.sleep(1.0)


def _audit(cfg: RunConfig, expected: set[str], upto: int | None = None) -> Accounting:
    from schemas.codec import decode_as
    from schemas.events import TrainingGroup
    from schemas.stale import describe_drop
    from workers.trainer.steplog import effective_trajectory_ids

    metrics = Path(cfg.trainer.metrics_file or Path(cfg.trainer.checkpoint_dir) / "metrics.jsonl")
    trained = effective_trajectory_ids(metrics, upto) if metrics.exists() else []
    stale: list[str] = []
    reasons: Counter[str] = Counter()
    for record in _read_topic(cfg.kafka, cfg.topics.name("stale")):
        group = decode_as(record.value, TrainingGroup)
        stale.extend(s.trajectory_id for s in group.samples)
        reasons[describe_drop(record.headers)] += len(group.samples)
    letters = [
        r.key.decode("utf-8", "replace")
        for r in _read_topic(cfg.kafka, cfg.topics.name("dlq"))
        if r.key is not None
    ]
    result = account(expected, trained, stale, letters)
    result.stale_reasons = dict(reasons)
    return result


class Supervisor:
    """Restarts what exits on its own; counts every start by process name."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.restarts: dict[str, int] = {}
        self.held: set[str] = set()  # being faulted: do not restart behind the fault's back

    def tick(self) -> None:
        for proc in self.pipe.processes:
            if proc.name in self.held or proc.alive:
                continue
            code = proc.proc.returncode if proc.proc is not None else None
            log.warning("%s exited (%s); starting it again", proc.name, code)
            self.pipe.restart(proc.name)
            self.restarts[proc.name] = self.restarts.get(proc.name, 0) + 1


def produce_prompts(cfg: RunConfig, rows: list[dict[str, Any]], n: int) -> set[str]:
    """Produce `rows` as prompts; the trajectory ids their samples will have."""
    from pipeline.data.producer import PromptProducer

    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(rows, uid_prefix="chaos")
    return expected_ids([r["uid"] for r in rows], n)


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    from pipeline.data.arithmetic import arithmetic_rows
    from pipeline.harness.models.tiny import init_model
    from pipeline.launch.local import LocalPipeline
    from pipeline.topics import create_topics

    started = time.monotonic()
    run = Path(opts.run_dir or tempfile.mkdtemp(prefix="rollout-chaos-"))
    run.mkdir(parents=True, exist_ok=True)
    broker: OwnBroker | ChaosCluster | None = None
    if opts.bootstrap is None:
        os.environ.setdefault("ROLLOUT_HOME", str(run / "home"))
        broker = ChaosCluster(run, opts.brokers) if opts.brokers > 1 else OwnBroker(run)
        broker.start()
    bootstrap = opts.bootstrap or (broker.bootstrap if broker else "")
    prefix = f"chaos-{uuid.uuid4().hex[:8]}."
    try:
        model = init_model(run / "model", "tiny", seed=opts.seed)
        cfg = chaos_config(opts, bootstrap, prefix, model, run)
        create_topics(cfg.kafka, cfg.topics)
        prompts = -(-opts.samples // opts.n)
        rows = arithmetic_rows(prompts, seed=opts.seed)
        expected = produce_prompts(cfg, rows, opts.n)
        topups = 0
        plan = schedule(list(opts.faults), opts.seed)
        log.info("chaos: %d samples, faults %s", len(expected), [(f.name, f.trigger) for f in plan])
        fired: list[dict[str, Any]] = []
        timeline: list[tuple[float, int, int]] = []
        outputs = {
            "agent-loop": ["turns"],
            "reward": ["scored"],
            "replay": ["replay", "stale"],
            "trainer": ["policy"],
        }
        turns = cfg.topics.name("turns")
        running: BrokerFaultThread | None = None  # a broker fault in progress
        pipe = LocalPipeline(
            cfg,
            run / "run",
            model_dir=str(model),
            replicas=opts.replicas,
            agent_loop_workers=opts.agent_loop_workers,
        )
        with (
            pipe,
            closing(
                ProgressWatch(
                    cfg.kafka,
                    {k: [cfg.topics.name(r) for r in roles] for k, roles in outputs.items()},
                )
            ) as watch,
        ):
            sup = Supervisor(pipe)
            deadline = started + opts.timeout_s
            result = audit(cfg, expected)
            scored = steps = 0
            last_audit = time.monotonic()
            steps_at_fault = -1
            while time.monotonic() < deadline:
                sup.tick()
                # Waiting to fire while the replicas generate: the window can be a few seconds
                # on a fast run, so look every 50 ms and audit (it reads topics) less often.
                waiting = opts.trigger == "generating" and bool(plan)
                # The share scored and the trainer's steps (sampled in the background) every
                # turn of the loop, so a fault can land early in a short run; the full audit
                # every 3 s.
                scored, steps = watch.value("reward"), watch.value("trainer")
                if running is not None and not running.is_alive():
                    if running.error is not None or running.record is None:
                        log.error("chaos: %s failed: %s", running.fault.name, running.error)
                        break
                    fired.append(broker_report(running, watch, opts.stall_window_s, started))
                    running, steps_at_fault = None, watch.value("trainer")
                if time.monotonic() - last_audit > (10.0 if waiting else 3.0):
                    result = audit(cfg, expected)
                    last_audit = time.monotonic()
                    timeline.append(
                        (round(time.monotonic() - started, 1), scored, result.accounted)
                    )
                    if opts.progress:
                        print(
                            f"  {timeline[-1][0]:7.1f}s scored {scored} trained/accounted "
                            f"{result.accounted}/{result.expected} restarts {sup.restarts}",
                            flush=True,
                        )
                # Faults fire on the share scored: it moves smoothly, training comes in steps.
                share = max(scored, result.accounted) / max(1, result.expected)
                scored_share = share
                if opts.trigger == "generating":
                    share = 1.0 if _generating(pipe.replica_urls) else 0.0
                # The next fault waits for the pipeline to have recovered from the last: the
                # trainer published a step since (progress, not seconds, so any machine fits).
                recovered = steps > steps_at_fault or share >= 1.0
                if (
                    plan
                    and opts.trigger == "scored"
                    and scored_share >= opts.topup_share
                    and topups < opts.max_topups
                ):
                    topups += 1
                    more = arithmetic_rows(prompts // 2, seed=opts.seed, split=f"topup{topups}")
                    expected |= produce_prompts(cfg, more, opts.n)
                    plan = [replace(f, trigger=0.0) for f in plan]  # overdue: fire when recovered
                    result = audit(cfg, expected)
                    log.info(
                        "chaos: %s pending at %.0f%% scored: %d more samples",
                        [f.name for f in plan],
                        100 * scored_share,
                        len(more) * opts.n,
                    )
                    if opts.progress:
                        print(f"  {len(more) * opts.n} more samples for {len(plan)} faults left")
                    continue
                if plan and opts.trigger == "scored" and scored_share >= opts.last_fault_share:
                    # Too late for the faults left: fail now, not after a drain.
                    log.error(
                        "chaos: %.0f%% scored and %s not fired: the run is too short for "
                        "its faults (raise --samples)",
                        100 * scored_share,
                        [f.name for f in plan],
                    )
                    break
                if plan and share >= plan[0].trigger and recovered and running is None:
                    fault = plan.pop(0)
                    log.info("chaos: %s at %.0f%%", fault.name, 100 * share)
                    if opts.progress:
                        print(f"  fault {fault.name} at {100 * share:.0f}%", flush=True)
                    if fault.on_cluster:
                        if not isinstance(broker, ChaosCluster):
                            raise ValueError(f"{fault.name} needs the run's own cluster")
                        timing = {"down_s": opts.broker_down_s, "stop_s": opts.broker_stop_s}
                        share_now = round(scored_share, 3)
                        running = BrokerFaultThread(fault, broker, turns, share_now, **timing)
                        running.start()
                        continue
                    at = time.monotonic()
                    single = broker if isinstance(broker, OwnBroker) else None
                    fired.append(inject(fault, pipe, sup, single, opts.stop_s))
                    fired[-1]["share"] = round(scored_share, 3)  # of samples scored by then
                    fired[-1]["at_s"] = round(at - started, 1)
                    if fault.kind == "broker":
                        fired[-1]["stall_s"] = stalls(
                            watch, at, time.monotonic(), opts.stall_window_s
                        )
                    steps_at_fault = watch.value("trainer")
                if not plan and running is None and result.accounted >= result.expected:
                    break
                if (plan or running is not None) and result.accounted >= result.expected:
                    # Nothing left for a fault to hit: report the faults that never fired.
                    log.warning(
                        "chaos: every sample accounted for before %s fired", [f.name for f in plan]
                    )
                    break
                time.sleep(0.05 if waiting else 0.25)
            # Let late duplicates (a resumed SIGSTOPped worker, a redelivery) surface.
            time.sleep(5.0)
            sup.tick()
            if running is not None:  # cut short by the deadline: its figures, if it ended
                running.join(timeout=300)
                if running.record is not None:
                    fired.append(broker_report(running, watch, opts.stall_window_s, started))
                else:
                    plan.insert(0, running.fault)
        from workers.weights.checkpoint import load_latest

        latest = load_latest(cfg.trainer.checkpoint_dir)
        final = audit(cfg, expected, upto=latest.state.version if latest is not None else 0)
        stale_share = round(final.stale / max(1, final.expected), 4)
        return {
            "ok": final.ok and not plan and stale_share <= opts.max_stale_share,
            "stale_share": stale_share,
            "stale_reasons": dict(sorted(final.stale_reasons.items())),
            "samples": len(expected),
            "samples_added": len(expected) - prompts * opts.n,
            "faults_fired": fired,
            "longest_stall_s": longest_stalls(fired),
            "faults_not_fired": [f.name for f in plan],
            "restarts": sup.restarts,
            "accounting": final.as_dict(),
            "table": final.table(),
            "wall_s": round(time.monotonic() - started, 1),
            "run_dir": str(run),
            "timeline": timeline[-20:],
        }
    finally:
        if broker is not None:
            broker.stop(purge=True)
