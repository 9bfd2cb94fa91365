"""`rollout bench failover`: what losing a broker costs the pipeline, on a three-broker cluster.

Each run starts a cluster of its own (`pipeline.harness.chaos.cluster.ChaosCluster`: topics
replicated 3, `min.insync.replicas` 2), the whole pipeline on it as the chaos suite runs it
(every stage its own process, the tiny model, one group per trainer step) and enough prompts to
keep it busy throughout. Once every stage is making progress it measures `before_s` seconds,
SIGKILLs the broker leading the most partitions of `rl.turns`, starts it again `down_s` later,
waits until every replica is back in sync, and measures `after_s` seconds more. Per run:

- `throughput`: trajectories scored per second (`rl.scored`) before the kill, from the kill
  until the cluster was whole again (`during`), and after; the same for every stage's output
  (`stage_rates`);
- `election_s`: from the SIGKILL until no partition of `rl.turns` is led by the dead broker
  (the controller fences it after `broker.session.timeout.ms`, 6000 on the local cluster);
- `stall_s`: each stage's longest time without progress around the kill (`longest_stall`,
  an upper bound: a topic whose partition has no leader cannot be counted) and `stall_max_s`,
  the time until every stage made progress again;
- `exits`: stages that exited on their own (and were started again): 0 when nothing treated
  the broker's loss as fatal.

The stall is expected within the brokers' session timeout (the dead leader is fenced and its
partitions' leaders move) plus the clients' retry backoff and metadata refresh; a consumer
group whose coordinator died re-finds it within its session timeout (10 s for the stages).
Nothing here is a ratio against a baseline: the figures are seconds and rates of one run.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["run"]

STAGES = {"agent-loop": ["turns"], "reward": ["scored"], "replay": ["replay", "stale"]}


def run(
    *,
    runs: int = 3,
    samples: int = 4000,
    before_s: float = 30.0,
    after_s: float = 30.0,
    down_s: float = 10.0,
    replicas: int = 2,
    workers: int = 2,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    from pipeline.broker.cluster import BROKER_SESSION_TIMEOUT_MS
    from workers.kafka.config import KafkaConfig

    results = [
        _one(
            samples=samples,
            before_s=before_s,
            after_s=after_s,
            down_s=down_s,
            replicas=replicas,
            workers=workers,
            seed=seed + i,
            progress=progress,
        )
        for i in range(runs)
    ]
    stalls = [r["stall_max_s"] for r in results]
    return {
        "runs": results,
        "stall_max_s": stalls,
        "stall_median_s": statistics.median(stalls),
        "election_s": [r["election_s"] for r in results],
        "throughput": [r["throughput"] for r in results],
        "exits": [r["exits"] for r in results],
        "configured": {
            "broker.session.timeout.ms": BROKER_SESSION_TIMEOUT_MS,
            "stage session_timeout_s": 10.0,
            "kafka.request_timeout_ms": KafkaConfig().request_timeout_ms,
            "kafka.delivery_timeout_ms": KafkaConfig().delivery_timeout_ms,
            "down_s": down_s,
        },
    }


def _one(
    *,
    samples: int,
    before_s: float,
    after_s: float,
    down_s: float,
    replicas: int,
    workers: int,
    seed: int,
    progress: bool,
) -> dict[str, Any]:
    from contextlib import closing

    from pipeline.broker.cluster import signal_node, start_node
    from pipeline.broker.leaders import partition_leaders, wait_in_sync
    from pipeline.data.arithmetic import arithmetic_rows
    from pipeline.harness.chaos.cluster import ChaosCluster, ProgressWatch, longest_stall
    from pipeline.harness.chaos.run import ChaosOptions, Supervisor, chaos_config, produce_prompts
    from pipeline.harness.models.tiny import init_model
    from pipeline.launch.local import LocalPipeline
    from pipeline.topics import create_topics

    home = Path(tempfile.mkdtemp(prefix="rollout-bench-failover-"))
    os.environ["ROLLOUT_HOME"] = str(home / "home")
    cluster = ChaosCluster(home)
    cluster.start()
    try:
        opts = ChaosOptions(samples=samples, replicas=replicas, agent_loop_workers=workers)
        model = init_model(home / "model", "tiny", seed=seed)
        cfg = chaos_config(
            opts, cluster.bootstrap, f"failover-{uuid.uuid4().hex[:8]}.", model, home
        )
        create_topics(cfg.kafka, cfg.topics)
        produce_prompts(cfg, arithmetic_rows(-(-samples // opts.n), seed=seed), opts.n)
        turns = cfg.topics.name("turns")
        pipe = LocalPipeline(
            cfg,
            home / "run",
            model_dir=str(model),
            replicas=replicas,
            agent_loop_workers=workers,
        )
        outputs = {**STAGES, "trainer": ["policy"]}
        names = {k: [cfg.topics.name(r) for r in roles] for k, roles in outputs.items()}
        with pipe, closing(ProgressWatch(cfg.kafka, names)) as watch:
            sup = Supervisor(pipe)

            def wait(seconds: float) -> None:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    sup.tick()
                    time.sleep(0.25)

            deadline = time.monotonic() + 600
            while not all(watch.value(stage) for stage in outputs):  # every stage flowing
                if time.monotonic() > deadline:
                    raise TimeoutError("the pipeline did not start within 600 s")
                wait(1.0)
            wait(before_s)
            led = partition_leaders(cfg.kafka, [turns])
            victim = max(led, key=lambda n: (len(led[n].get(turns, [])), -n))
            _say(progress, f"seed {seed}: SIGKILL broker {victim} (leads {led[victim]})")
            killed = time.monotonic()
            signal_node(cluster.state, victim, signal.SIGKILL)
            election = None
            while time.monotonic() < killed + down_s:
                if election is None and victim not in partition_leaders(cfg.kafka, [turns]):
                    election = time.monotonic() - killed
                wait(0.25)
            start_node(cluster.state, victim, timeout_s=300)
            wait_in_sync(cfg.kafka, timeout_s=300)
            back = time.monotonic()
            wait(after_s)
            ended = time.monotonic()
            stall = {
                stage: longest_stall(watch.grew(stage), killed, back, watch.seen(stage))
                for stage in outputs
            }
            windows = {
                "before": (killed - before_s, killed),
                "during": (killed, back),
                "after": (back, ended),
            }
            result = {
                "seed": seed,
                "victim": victim,
                "election_s": round(election, 1) if election is not None else None,
                "down_s": down_s,
                "back_in_sync_s": round(back - killed, 1),
                "throughput": {w: watch.rate("reward", a, b) for w, (a, b) in windows.items()},
                "stage_rates": {
                    stage: {w: watch.rate(stage, a, b) for w, (a, b) in windows.items()}
                    for stage in outputs
                },
                "stall_s": stall,
                "stall_max_s": max(stall.values()),
                "exits": dict(sup.restarts),
            }
            _say(progress, f"seed {seed}: {result}")
            return result
    finally:
        cluster.stop(purge=True)
        shutil.rmtree(home, ignore_errors=True)


def _say(progress: bool, line: str) -> None:
    if progress:
        import sys

        print(line, file=sys.stderr, flush=True)
