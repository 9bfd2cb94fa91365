"""The chaos suite on a three-broker cluster: the broker faults, and how long each stage
stalled around them.

- `ChaosCluster`: the run's own cluster (`pipeline.broker.cluster`, free ports, data in the run
  directory), stopped and purged at the end.
- `fire_broker_fault(fault, cluster, topic)`: one broker fault, blocking until the cluster is
  whole again (every broker registered, every replica back in sync), so the next fault never
  lands on a cluster still recovering from this one:
    kill:broker[-N]  SIGKILL the broker leading the most partitions of `topic` (`rl.turns`; or
                     node N), start it again `down_s` later;
    stop:broker[-N]  SIGSTOP it for `stop_s` (past the brokers' session timeout, so it is fenced
                     and its partitions' leaders move, and past the stages' session timeouts),
                     then SIGCONT: it comes back with a stale view and must catch up;
    bounce:brokers   a rolling restart of every broker, as an upgrade: SIGTERM (a controlled
                     shutdown moves its leaders first), start, wait until every replica is in
                     sync, then the next.
  The driver runs it in a thread, so the stages' supervisor and the progress watch go on.
- `ProgressWatch`: each stage's progress (the records ever written to its output topic, from
  end offsets) sampled in a thread of its own per topic, with the moments it grew.
  `longest_stall(grew, start, end, until)`: the longest time without growth that overlaps the
  window [start, end] (a gap closed by growth; open only if the stage never grew again).
  While a partition of a topic has no leader its end offsets cannot be read, so that time
  counts as stalled: the figure is an upper bound.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.harness.chaos.faults import Fault
from workers.kafka.config import KafkaConfig

__all__ = [
    "BrokerFaultThread",
    "ChaosCluster",
    "ProgressWatch",
    "broker_report",
    "fire_broker_fault",
    "longest_stall",
    "longest_stalls",
    "stalls",
]

log = logging.getLogger("rollout.chaos.cluster")

#: Progress is sampled this often, each output topic by its own thread and consumer.
SAMPLE_S = 0.25
#: A sample waits at most this long for a broker (one that is frozen, or just died).
SAMPLE_TIMEOUT_MS = 5000


class ChaosCluster:
    """The run's own cluster of `brokers` brokers."""

    def __init__(self, home: Path, brokers: int = 3) -> None:
        from workers.ports import free_port

        self.ports = [free_port() for _ in range(brokers)]
        self.data = home / "kafka-cluster"
        self.state: Any = None

    @property
    def bootstrap(self) -> str:
        return str(self.state.bootstrap)

    def start(self) -> None:
        from pipeline.broker.cluster import start_cluster

        self.state = start_cluster(
            self.ports[0], len(self.ports), self.data, ports=self.ports, quiet=True
        )

    def stop(self, purge: bool = False) -> None:
        from pipeline.broker.cluster import stop_cluster

        stop_cluster(self.ports[0], purge=purge)


def _target(fault: Fault, cluster: ChaosCluster, topic: str) -> int:
    """The node a broker fault hits: the one named, else the leader of most of `topic`."""
    from pipeline.broker.leaders import partition_leaders

    if fault.target.startswith("broker-"):
        return int(fault.target.removeprefix("broker-"))
    led = partition_leaders(cluster.state.kafka(), [topic])
    return max(cluster.state.nodes, key=lambda n: (sum(map(len, led.get(n, {}).values())), -n))


def fire_broker_fault(
    fault: Fault, cluster: ChaosCluster, topic: str, *, down_s: float, stop_s: float
) -> dict[str, Any]:
    """Fire `fault` (kill:, stop: or bounce: of brokers) and return once the cluster is whole:
    what was hit, when (monotonic), and how long each part took."""
    from pipeline.broker.cluster import signal_node, start_node, stop_node
    from pipeline.broker.leaders import wait_in_sync

    state = cluster.state
    started = time.monotonic()
    record: dict[str, Any] = {"started": started}
    if fault.kind == "bounce":
        record["nodes"] = list(state.nodes)
        for node in state.nodes:
            stop_node(state, node)
            start_node(state, node, timeout_s=180)
            wait_in_sync(state.kafka(), timeout_s=300)
        record["fault"] = "bounce:brokers"
    else:
        node = _target(fault, cluster, topic)
        record["node"] = node
        record["fault"] = f"{fault.kind}:broker-{node}"
        if fault.kind == "kill":
            signal_node(state, node, signal.SIGKILL)
            time.sleep(down_s)
            start_node(state, node, timeout_s=180)
        elif fault.kind == "stop":
            signal_node(state, node, signal.SIGSTOP)
            time.sleep(stop_s)
            signal_node(state, node, signal.SIGCONT)
        else:
            raise ValueError(f"{fault.name}: not a broker fault")
        record["back_s"] = round(time.monotonic() - started, 1)
        wait_in_sync(state.kafka(), timeout_s=300)
    record["ended"] = time.monotonic()
    record["in_sync_s"] = round(record["ended"] - started, 1)
    return record


class BrokerFaultThread(threading.Thread):
    """`fire_broker_fault` in the background: `record` once done, `error` if it failed."""

    def __init__(
        self, fault: Fault, cluster: ChaosCluster, topic: str, share: float, **timing: float
    ) -> None:
        super().__init__(daemon=True, name=f"fault-{fault.name}")
        self.fault, self.cluster, self.topic, self.timing = fault, cluster, topic, timing
        self.share = share  # of the samples scored when it fired
        self.started_at = time.monotonic()
        self.record: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.record = fire_broker_fault(self.fault, self.cluster, self.topic, **self.timing)
        except BaseException as exc:  # reported by the driver, which fails the run
            log.exception("broker fault %s failed", self.fault.name)
            self.error = exc


@dataclass
class _Topic:
    names: list[str]
    value: int = 0
    grew: list[float] = field(default_factory=list)  # monotonic moments the count grew
    history: list[tuple[float, int]] = field(default_factory=list)  # (moment, count) on growth
    seen: float = 0.0  # the last moment a sample succeeded


class ProgressWatch:
    """Per stage, the records ever written to its output topics, sampled in the background.

    `stages` maps a stage to its output topics (`{"reward": ["rl.scored"]}`); `value(stage)` is
    the latest count (never blocks), `grew(stage)` the moments it grew.
    """

    def __init__(self, kafka: KafkaConfig, stages: dict[str, list[str]]) -> None:
        # A sample waits seconds, not the clients' 30 s, for a broker that just died.
        self._kafka = kafka.model_copy(update={"request_timeout_ms": SAMPLE_TIMEOUT_MS})
        self._topics = {stage: _Topic(list(names)) for stage, names in stages.items()}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(t,), daemon=True, name=f"watch-{s}")
            for s, t in self._topics.items()
        ]
        for thread in self._threads:
            thread.start()

    def value(self, stage: str) -> int:
        return self._topics[stage].value

    def grew(self, stage: str) -> list[float]:
        return list(self._topics[stage].grew)

    def seen(self, stage: str) -> float:
        return self._topics[stage].seen

    def count_at(self, stage: str, moment: float) -> int:
        """The stage's count as last sampled at or before `moment` (monotonic)."""
        count = 0
        for at, value in self._topics[stage].history:
            if at > moment:
                break
            count = value
        return count

    def rate(self, stage: str, start: float, end: float) -> float:
        """Records a second the stage wrote between `start` and `end` (monotonic)."""
        grown = self.count_at(stage, end) - self.count_at(stage, start)
        return round(grown / max(end - start, 1e-9), 2)

    @property
    def stages(self) -> list[str]:
        return list(self._topics)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=SAMPLE_TIMEOUT_MS / 1000 + 5)

    def _run(self, topic: _Topic) -> None:
        from kafka import TopicPartition

        consumer: Any = None
        tps: list[TopicPartition] = []
        while not self._stop.wait(SAMPLE_S):
            try:
                if consumer is None:
                    consumer = self._consumer()
                    tps = [
                        TopicPartition(name, p)
                        for name in topic.names
                        for p in sorted(consumer.partitions_for_topic(name) or ())
                    ]
                value = sum(consumer.end_offsets(tps).values())
            except Exception as exc:
                # A fresh client next time: kafka-python 3.0.12 with a short request timeout
                # kept timing out on a broker that had been SIGSTOPped and resumed (its old
                # connection), sample after sample, while a new client was answered; and a new
                # client's bootstrap gives up on a frozen broker.
                log.debug("progress of %s not read: %r", topic.names, exc)
                if consumer is not None:
                    consumer.close()
                consumer = None
                continue
            now = time.monotonic()
            if value > topic.value:
                topic.grew.append(now)
                topic.history.append((now, value))
            topic.value, topic.seen = max(topic.value, value), now
        if consumer is not None:
            consumer.close()

    def _consumer(self) -> Any:
        from workers.kafka.clients import make_consumer

        return make_consumer(self._kafka, group_id=None, name="chaos-progress")


def broker_report(
    done: BrokerFaultThread, watch: ProgressWatch, window_s: float, started: float
) -> dict[str, Any]:
    """A finished broker fault's entry in the run's report: what it hit, when (seconds into
    the run from `started`), how long, and each stage's longest stall around it."""
    record = dict(done.record or {})
    begin, end = record.pop("started"), record.pop("ended")
    record.update(
        trigger=done.fault.trigger,
        share=done.share,
        at_s=round(begin - started, 1),
        seconds=round(end - begin, 1),
        stall_s=stalls(watch, begin, end, window_s),
    )
    return record


def longest_stalls(fired: list[dict[str, Any]]) -> dict[str, float]:
    """Each stage's longest stall around any of the broker faults in `fired`."""
    out: dict[str, float] = {}
    for fault in fired:
        for stage, seconds in fault.get("stall_s", {}).items():
            out[stage] = max(out.get(stage, 0.0), seconds)
    return out


def stalls(watch: ProgressWatch, started: float, ended: float, after_s: float) -> dict[str, float]:
    """Each stage's longest stall around a fault that ran from `started` to `ended`
    (monotonic), looking `after_s` past its end."""
    return {
        stage: longest_stall(watch.grew(stage), started, ended + after_s, watch.seen(stage))
        for stage in watch.stages
    }


def longest_stall(grew: list[float], start: float, end: float, until: float) -> float:
    """The longest time without growth that overlaps [start, end], between the moments in
    `grew` (sorted); if it never grew after `start`, the open time until `until` (the last
    sample). A stage that finished its work is not stalled: only closed gaps count otherwise."""
    before = [t for t in grew if t <= start]
    after = [t for t in grew if t > start]
    points = ([before[-1]] if before else [start]) + after + ([] if after else [until])
    longest = 0.0
    for a, b in itertools.pairwise(points):
        if b >= start and a <= end:
            longest = max(longest, b - a)
    return round(longest, 1)
