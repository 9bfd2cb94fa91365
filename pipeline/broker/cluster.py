"""A local Kafka cluster of several brokers on one machine: `rollout kafka up --brokers 3`.

Each node is a KRaft combined node (broker and controller in one JVM, `node.id` 1..N) with its
own client port, controller port and data directory; the controllers form a static quorum of N
voters (`controller.quorum.voters`), so any one node can die and the other two still elect a
leader of the metadata log and of every partition. The nodes' config comes from
`infra/kafka/cluster.properties.template`: every internal topic replicated 3 with
`min.insync.replicas` 2, no unclean leader election, and a broker fenced (its partitions' leaders
moved) after `BROKER_SESSION_TIMEOUT_MS` without a heartbeat.

Invariants:
- `start_cluster` is idempotent: a cluster whose nodes all answer is reused; a node that is down
  (killed, crashed) is started again on its own port and data, never a second copy.
- every node is also recorded as a one-broker `BrokerState` under its port, so `down --port P`
  of any member and the pid checks of `pipeline.broker.local` work on it; the cluster itself is
  `ClusterState`, named by its first broker's port.
- readiness is the cluster's own answer: every node listed by a metadata request (a fenced or
  still-registering broker is not), not a sleep.
- processes are found by the pids recorded and checked against their command line; never by name.
"""

from __future__ import annotations

import json
import os
import signal
import string
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.broker.leaders import partition_leaders, under_replicated
from pipeline.broker.local import (
    _cluster_id,
    _is_our_broker,
    _java,
    _metadata_ok,
    _pid_alive,
    _reap,
    ensure_jars,
    port_open,
)
from pipeline.broker.state import INFRA, BrokerState, rollout_home
from workers.kafka.config import KafkaConfig
from workers.kafka.exceptions import KafkaUnavailableError
from workers.ports import free_port

__all__ = [
    "BROKER_SESSION_TIMEOUT_MS",
    "ClusterState",
    "cluster_status",
    "find_cluster",
    "signal_node",
    "start_cluster",
    "start_node",
    "stop_cluster",
    "stop_node",
]

#: The controller fences a broker silent this long; its partitions' leaders move then.
BROKER_SESSION_TIMEOUT_MS = 6000
HOST = "127.0.0.1"


@dataclass
class ClusterState:
    """What `up --brokers N` records so that `status`, `down` and the chaos suite find every
    node again: node `i` (1-based) listens on `ports[i-1]` and `controller_ports[i-1]`."""

    port: int
    ports: list[int]
    controller_ports: list[int]
    data_dir: str
    cluster_id: str
    heap: str
    started_at: float
    reused: bool = field(default=False, compare=False)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"localhost:{p}" for p in self.ports)

    @property
    def nodes(self) -> list[int]:
        return list(range(1, len(self.ports) + 1))

    def port_of(self, node: int) -> int:
        return self.ports[node - 1]

    def node_dir(self, node: int) -> Path:
        return Path(self.data_dir) / f"node-{node}"

    def kafka(self) -> KafkaConfig:
        return KafkaConfig(bootstrap_servers=self.bootstrap)

    @classmethod
    def path_for(cls, port: int) -> Path:
        return rollout_home() / f"kafka-cluster-{port}.json"

    def save(self) -> None:
        path = self.path_for(self.port)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: v for k, v in asdict(self).items() if k != "reused"}))
        tmp.replace(path)

    @classmethod
    def load(cls, port: int) -> ClusterState | None:
        try:
            return cls(**json.loads(cls.path_for(port).read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None


def find_cluster(port: int) -> ClusterState | None:
    """The cluster `port` belongs to (as its first broker or any member), if `up` made one."""
    if (state := ClusterState.load(port)) is not None:
        return state
    for path in rollout_home().glob("kafka-cluster-*.json"):
        state = ClusterState.load(int(path.stem.rsplit("-", 1)[1]))
        if state is not None and port in state.ports:
            return state
    return None


def start_cluster(
    port: int = 9092,
    brokers: int = 3,
    data_dir: str | Path | None = None,
    *,
    ports: list[int] | None = None,
    heap: str = "512m",
    timeout_s: float = 180.0,
    quiet: bool = False,
) -> ClusterState:
    """Start (or reuse, or complete) a cluster of `brokers` nodes; return once every node is
    registered and answering. Client ports are `ports`, else `port`, `port+1`, …"""
    if brokers < 3:
        raise KafkaUnavailableError("a cluster has at least 3 brokers (one broker: kafka up)")
    started = time.monotonic()
    state = ClusterState.load(port)
    if state is not None and len(state.ports) != brokers:
        raise KafkaUnavailableError(
            f"a cluster of {len(state.ports)} brokers is recorded at port {port}: "
            f"`rollout kafka down --port {port}` first"
        )
    if state is None:
        ports = list(ports or [port + i for i in range(brokers)])
        if taken := [p for p in ports if port_open(HOST, p)]:
            raise KafkaUnavailableError(
                f"port{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} taken: "
                "a cluster needs one free port per broker (--port picks the first)"
            )
        data = Path(data_dir) if data_dir else rollout_home() / f"kafka-cluster-{port}"
        state = ClusterState(
            port=ports[0],
            ports=ports,
            controller_ports=[free_port() for _ in ports],
            data_dir=str(data.expanduser().resolve()),
            cluster_id=_cluster_id(),
            heap=heap,
            started_at=time.time(),
        )
        state.save()
    down = [n for n in state.nodes if not _node_running(state, n)]
    if not down and _registered(state, timeout_s=5.0) == set(state.nodes):
        state.reused = True
        return state
    lib = ensure_jars(quiet=quiet)
    _format(state, [n for n in down if not _formatted(state, n)], lib)
    procs = {n: _spawn(state, n, lib) for n in down}
    try:
        _wait_registered(state, set(state.nodes), timeout_s, procs)
    except BaseException:
        for proc in procs.values():  # never leave a node nobody tracks
            proc.kill()
            proc.wait()
        raise
    if not quiet:
        print(
            f"Kafka cluster of {brokers} up at {state.bootstrap} in "
            f"{time.monotonic() - started:.1f}s (data {state.data_dir})",
            file=sys.stderr,
        )
    return state


def start_node(state: ClusterState, node: int, *, timeout_s: float = 120.0) -> int:
    """Start node `node` again (same port, data and config); its pid once it is registered."""
    if _node_running(state, node):
        raise KafkaUnavailableError(f"broker {node} of the cluster is already running")
    proc = _spawn(state, node, ensure_jars(quiet=True))
    try:
        _wait_registered(state, {node}, timeout_s, {node: proc})
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc.pid


def signal_node(state: ClusterState, node: int, sig: signal.Signals) -> int:
    """Send `sig` to node `node`'s JVM (checked to be the one `up` started); its pid."""
    record = BrokerState.load(state.port_of(node))
    if record is None or not _is_our_broker(record):
        raise KafkaUnavailableError(f"broker {node} of the cluster is not running")
    os.kill(record.pid, sig)
    return record.pid


def stop_node(state: ClusterState, node: int, *, grace_s: float = 60.0) -> bool:
    """SIGTERM node `node` (a controlled shutdown: its leaders move first), SIGKILL after
    `grace_s`; wait until the process is gone. False if it was not running."""
    return bool(_stop(state, [node], grace_s))


def stop_cluster(port: int = 9092, *, grace_s: float = 30.0, purge: bool = False) -> bool:
    """Stop every node of the cluster recorded at `port` (all at once: the last ones cannot
    move their leaders anywhere). False if there was no such cluster."""
    state = find_cluster(port)
    if state is None:
        return False
    _stop(state, state.nodes, grace_s)
    for p in state.ports:
        BrokerState.path_for(p).unlink(missing_ok=True)
    ClusterState.path_for(state.port).unlink(missing_ok=True)
    if purge:
        import shutil

        shutil.rmtree(state.data_dir, ignore_errors=True)
    return True


def cluster_status(state: ClusterState) -> dict[str, Any]:
    """Each node (port, pid, running, registered) and the partitions it leads, by topic."""
    registered = _registered(state, timeout_s=3.0)
    leaders: dict[int, dict[str, list[int]]] = {}
    lagging = None
    if registered:
        try:
            leaders = partition_leaders(state.kafka())
            lagging = under_replicated(state.kafka())
        except KafkaUnavailableError:
            pass
    brokers = []
    for node in state.nodes:
        record = BrokerState.load(state.port_of(node))
        leads = leaders.get(node, {})
        brokers.append(
            {
                "node": node,
                "bootstrap": f"localhost:{state.port_of(node)}",
                "pid": record.pid if record else None,
                "running": _node_running(state, node),
                "registered": node in registered,
                "partitions_led": sum(len(parts) for parts in leads.values()),
                "leads": {topic: parts for topic, parts in sorted(leads.items())},
            }
        )
    return {
        "bootstrap": state.bootstrap,
        "brokers": brokers,
        "answering": bool(registered),
        "under_replicated_partitions": lagging,
        "data_dir": state.data_dir,
    }


# --- internals -------------------------------------------------------------------------


def _node_running(state: ClusterState, node: int) -> bool:
    record = BrokerState.load(state.port_of(node))
    return record is not None and _is_our_broker(record)


def _formatted(state: ClusterState, node: int) -> bool:
    return (state.node_dir(node) / "logs" / "meta.properties").exists()


def _render(state: ClusterState, node: int) -> Path:
    voters = ",".join(f"{n}@localhost:{state.controller_ports[n - 1]}" for n in state.nodes)
    directory = state.node_dir(node)
    directory.mkdir(parents=True, exist_ok=True)
    template = string.Template((INFRA / "cluster.properties.template").read_text())
    props = directory / "server.properties"
    props.write_text(
        template.substitute(
            node_id=node,
            voters=voters,
            host=HOST,
            advertised_host="localhost",
            port=state.port_of(node),
            controller_port=state.controller_ports[node - 1],
            log_dir=directory / "logs",
            broker_session_timeout_ms=BROKER_SESSION_TIMEOUT_MS,
        )
    )
    return props


def _format(state: ClusterState, nodes: list[int], lib: Path) -> None:
    """Format the storage of `nodes` with the cluster's id (in parallel: a JVM start each)."""
    running = [
        (n, subprocess.Popen(
            _java(lib, "kafka.tools.StorageTool", "format", "-t", state.cluster_id,
                  "-c", str(_render(state, n))),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
        for n in nodes
    ]  # fmt: skip
    for node, proc in running:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise KafkaUnavailableError(f"formatting broker {node}'s storage failed:\n{out}")


def _spawn(state: ClusterState, node: int, lib: Path) -> subprocess.Popen[bytes]:
    props = _render(state, node)
    directory = state.node_dir(node)
    with open(directory / "server.log", "ab") as logfile:
        proc = subprocess.Popen(
            _java(lib, "kafka.Kafka", str(props), heap=state.heap),
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    port = state.port_of(node)
    BrokerState(
        proc.pid, port, state.controller_ports[node - 1], str(directory),
        f"localhost:{port}", time.time(),
    ).save()  # fmt: skip
    return proc


def _registered(state: ClusterState, timeout_s: float) -> set[int]:
    """The node ids the cluster's metadata lists now (registered and not fenced)."""
    from kafka.errors import KafkaError

    from workers.kafka.clients import make_admin

    live = [p for p in state.ports if port_open(HOST, p)]
    if not live:
        return set()
    kafka = KafkaConfig(bootstrap_servers=",".join(f"localhost:{p}" for p in live))
    timeout_ms = int(timeout_s * 1000)
    try:
        admin = make_admin(
            kafka, name="probe", request_timeout_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms
        )
    except (KafkaUnavailableError, KafkaError, OSError):
        return set()
    try:
        described = admin.describe_cluster()
        brokers = described.get("brokers", [])
        return {int(b["broker_id"]) for b in brokers if not b.get("is_fenced", False)}
    except (KafkaError, OSError):
        return set()
    finally:
        admin.close()


def _wait_registered(
    state: ClusterState,
    nodes: set[int],
    timeout_s: float,
    procs: dict[int, subprocess.Popen[bytes]],
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node, proc in procs.items():
            if proc.poll() is not None:
                log = (state.node_dir(node) / "server.log").read_text(errors="replace")[-3000:]
                raise KafkaUnavailableError(f"broker {node} exited with {proc.returncode}:\n{log}")
        if nodes <= _registered(state, timeout_s=2.0) and all(
            _metadata_ok(KafkaConfig(bootstrap_servers=f"localhost:{state.port_of(n)}"))
            for n in nodes
        ):
            return
        time.sleep(0.3)
    raise KafkaUnavailableError(
        f"brokers {sorted(nodes)} not registered within {timeout_s:.0f}s; see "
        f"{state.data_dir}/node-*/server.log"
    )


def _stop(state: ClusterState, nodes: list[int], grace_s: float) -> int:
    pids = {}
    for node in nodes:
        record = BrokerState.load(state.port_of(node))
        if record is not None and _is_our_broker(record):
            os.kill(record.pid, signal.SIGCONT)  # a stopped JVM cannot act on SIGTERM
            os.kill(record.pid, signal.SIGTERM)
            pids[node] = record.pid
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids.values()):
        for pid in pids.values():
            _reap(pid)
        time.sleep(0.1)
    for pid in pids.values():
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _pid_alive(pid):
                _reap(pid)
                time.sleep(0.05)
    return len(pids)
