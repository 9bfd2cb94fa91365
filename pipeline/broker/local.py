"""A real Apache Kafka broker on this machine, without Docker: `rollout kafka up|down|status`.

The broker's jars (org.apache.kafka:kafka_2.13 and its runtime dependencies) are resolved
once by Maven from `infra/kafka/pom.xml` into a cache directory keyed by the pom's hash, so
later starts need no network. The broker runs in KRaft combined mode (broker + controller,
one node) from a data directory the launcher formats on first use.

Invariants:
- `up` is idempotent: a broker already answering on the port is reused, never doubled.
- readiness is a real metadata request answered by the broker, not a sleep.
- `down` stops only the process this launcher started (pid and command line checked),
  SIGTERM first, SIGKILL after a grace period; never by process name.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from pipeline.broker.state import INFRA, BrokerState, cache_home, rollout_home
from workers.kafka.config import KafkaConfig
from workers.kafka.exceptions import KafkaUnavailableError
from workers.ports import free_port, is_loopback

__all__ = [
    "BrokerState",
    "broker_status",
    "ensure_jars",
    "port_open",
    "start_broker",
    "stop_broker",
]

log = logging.getLogger("rollout.kafka.local")


def ensure_jars(*, quiet: bool = False) -> Path:
    """The directory holding the broker's jars, resolving them with Maven on first use."""
    pom = INFRA / "pom.xml"
    if not pom.exists():
        raise KafkaUnavailableError(f"{pom} not found: run from a checkout of rollout-pipeline")
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:12]
    lib = cache_home() / f"kafka-{digest}" / "lib"
    if (lib / ".complete").exists():
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaUnavailableError("Maven (mvn) is needed once to resolve the Kafka jars")
    started = time.monotonic()
    tmp = lib.with_name("lib.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(pom),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={tmp}",
    ]
    if not quiet:
        print(f"resolving Kafka jars with Maven into {lib} (once)…", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise KafkaUnavailableError(
            f"Maven could not resolve the Kafka jars:\n{result.stdout[-3000:]}"
        )
    (tmp / ".complete").write_text(str(time.time()))
    shutil.rmtree(lib, ignore_errors=True)
    tmp.replace(lib)
    if not quiet:
        print(f"resolved Kafka jars in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return lib


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at `host:port` now (IPv4 or IPv6)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _metadata_ok(probe: KafkaConfig, timeout_s: float = 2.0) -> bool:
    """True when a broker at `probe`'s address answers a metadata request within `timeout_s`
    (`probe` carries the admin's SASL/SSL settings for a secure broker)."""
    from kafka.errors import KafkaError

    from workers.kafka.clients import make_admin

    timeout_ms = int(timeout_s * 1000)
    try:
        admin = make_admin(
            probe, name="probe", request_timeout_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms
        )
    except (KafkaUnavailableError, KafkaError, OSError, ValueError):
        return False
    try:
        admin.describe_cluster()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_our_broker(state: BrokerState) -> bool:
    """The pid is alive and still the broker we started (guards against pid reuse)."""
    if not _pid_alive(state.pid):
        return False
    try:
        cmdline = Path(f"/proc/{state.pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return True
    return "kafka.Kafka" in cmdline and state.data_dir in cmdline


def _java(lib: Path, main: str, *args: str, heap: str = "256m") -> list[str]:
    java = shutil.which("java")
    if java is None:
        raise KafkaUnavailableError("Java 17+ is needed to run the local Kafka broker")
    return [
        java,
        f"-Xmx{heap}",
        "-Xms128m",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={INFRA / 'log4j2.properties'}",
        "-cp",
        f"{lib}/*",
        main,
        *args,
    ]


def start_broker(
    port: int = 9092,
    data_dir: str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    advertised_host: str = "localhost",
    heap: str = "1g",
    timeout_s: float = 90.0,
    quiet: bool = False,
    secure: bool = False,
    users: Sequence[str] = (),
) -> BrokerState:
    """Start (or reuse) a single-node KRaft broker; return once it answers metadata.

    `secure=True`: a SASL_SSL listener (SCRAM-SHA-512, TLS from a CA of its own) with ACLs
    instead of PLAINTEXT; `users` get SCRAM credentials besides `admin` (see
    `pipeline.broker.secure`). `advertised_host`: where clients are told to connect; one
    that is not loopback (other nodes' clients) makes the broker listen on every interface.
    """
    if not is_loopback(advertised_host):
        host = "0.0.0.0"
    started = time.monotonic()
    bootstrap = f"localhost:{port}"
    state = BrokerState.load(port)
    if state is not None and _is_our_broker(state) and _metadata_ok(_probe(bootstrap, state)):
        if state.secure != secure:
            raise KafkaUnavailableError(
                f"a {'secure' if state.secure else 'plain'} broker already runs on port {port}"
            )
        if secure and users:
            _secure_users(state.data_dir, bootstrap, users)
        state.reused = True
        return state
    if port_open(host, port):
        if secure:
            raise KafkaUnavailableError(f"port {port} is taken by a process `up` did not start")
        if _metadata_ok(KafkaConfig(bootstrap_servers=bootstrap)):
            return BrokerState(-1, port, -1, "", bootstrap, time.time(), reused=True)
        raise KafkaUnavailableError(f"port {port} is taken by something that is not Kafka")

    lib = ensure_jars(quiet=quiet)
    data = Path(data_dir) if data_dir else rollout_home() / f"kafka-{port}"
    data = data.expanduser().resolve()
    data.mkdir(parents=True, exist_ok=True)
    # KRaft keeps the controller's endpoint in its log: a restarted node keeps its port.
    saved = data / "controller.port"
    formatted = (data / "logs" / "meta.properties").exists()
    controller_port = int(saved.read_text()) if formatted and saved.exists() else free_port()
    props = data / "server.properties"
    if formatted and secure != (data / "credentials.json").exists():
        kind = "plain" if secure else "secure"
        raise KafkaUnavailableError(f"{data} holds a {kind} broker's data: start it as one")
    setup = None
    if secure:
        from pipeline.broker import secure as kafka_secure

        setup = kafka_secure.prepare(
            data,
            host=host,
            advertised_host=advertised_host,
            port=port,
            controller_port=controller_port,
            users=users,
        )
    else:
        template = string.Template((INFRA / "server.properties.template").read_text())
        props.write_text(
            template.substitute(
                host=host,
                advertised_host=advertised_host,
                port=port,
                controller_port=controller_port,
                log_dir=data / "logs",
            )
        )
    probe = setup.admin_config(bootstrap) if setup else KafkaConfig(bootstrap_servers=bootstrap)
    if not formatted:
        fmt_args = [
            "kafka.tools.StorageTool",
            "format",
            "--standalone",
            "-t",
            _cluster_id(),
            "-c",
            str(props),
        ]
        if setup is not None:
            # SCRAM users at format time; the passwords go through a 0600 argument file.
            with kafka_secure.java_argfile(data, fmt_args + setup.scram_format_args()) as af:
                result = subprocess.run(_java(lib, af), capture_output=True, text=True, check=False)
        else:
            fmt = _java(lib, *fmt_args)
            result = subprocess.run(fmt, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KafkaUnavailableError(
                f"formatting KRaft storage failed:\n{result.stdout}{result.stderr}"
            )
        saved.write_text(str(controller_port))

    logfile = open(data / "server.log", "ab")
    proc = subprocess.Popen(
        _java(lib, "kafka.Kafka", str(props), heap=heap),
        stdout=logfile,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    logfile.close()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (data / "server.log").read_text(errors="replace")[-3000:]
                raise KafkaUnavailableError(f"the broker exited with {proc.returncode}:\n{tail}")
            if port_open(host, port) and _metadata_ok(probe):
                state = BrokerState(
                    proc.pid,
                    port,
                    controller_port,
                    str(data),
                    bootstrap,
                    time.time(),
                    secure=secure,
                )
                state.save()
                if setup is not None and formatted and setup.added_users:
                    _secure_users(str(data), bootstrap, setup.added_users)
                if not quiet:
                    print(
                        f"Kafka up at {bootstrap} in {time.monotonic() - started:.1f}s "
                        f"(pid {proc.pid}, data {data})",
                        file=sys.stderr,
                    )
                return state
            time.sleep(0.2)
    except BaseException:
        # Interrupted (Ctrl-C) or failed while waiting: never leave a broker nobody tracks.
        proc.kill()
        proc.wait()
        raise
    proc.kill()
    raise KafkaUnavailableError(
        f"the broker did not answer within {timeout_s:.0f}s; see {data / 'server.log'}"
    )


def _probe(bootstrap: str, state: BrokerState | None) -> KafkaConfig:
    """How the readiness probe connects to `bootstrap`: as the admin for a secure broker."""
    plain = KafkaConfig(bootstrap_servers=bootstrap)
    if state is None or not state.secure:
        return plain
    from pipeline.broker.secure import SecureBrokerError, client_config

    try:
        return client_config(bootstrap, state.data_dir, "admin")
    except SecureBrokerError:
        return plain  # credentials gone (purged data dir): the probe then fails, as it should


def _secure_users(data_dir: str, bootstrap: str, users: Sequence[str]) -> None:
    """Give `users` credentials on a running secure broker (new ones, or ones never created)."""
    from pipeline.broker import access as kafka_access
    from pipeline.broker import secure as kafka_secure

    creds, _ = kafka_secure.ensure_credentials(Path(data_dir), users)
    admin = kafka_secure.client_config(bootstrap, data_dir, kafka_secure.ADMIN_USER)
    kafka_access.ensure_users(admin, creds, list(users))


def _cluster_id() -> str:
    # Same format as `StorageTool random-uuid` (url-safe base64 of 16 random bytes), without
    # paying for a JVM start. Like Kafka's own Uuid.randomUuid, never one that starts with
    # '-': the storage tool's parser reads `-t -abc…` as a missing value (1 start in 64 failed
    # that way: a CI run lost its broker to it).
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def stop_broker(port: int = 9092, *, grace_s: float = 30.0, purge: bool = False) -> bool:
    """Stop the broker `up` started on `port`. False if there was none."""
    state = BrokerState.load(port)
    if state is None:
        return False
    stopped = False
    if _is_our_broker(state):
        os.kill(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _pid_alive(state.pid):
            _reap(state.pid)
            time.sleep(0.1)
        if _pid_alive(state.pid):
            os.kill(state.pid, signal.SIGKILL)
            _reap(state.pid)
        stopped = True
    BrokerState.path_for(port).unlink(missing_ok=True)
    if purge and state.data_dir:
        shutil.rmtree(state.data_dir, ignore_errors=True)
    return stopped


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def broker_status(port: int = 9092) -> dict[str, object]:
    """What is known about the broker on `port`."""
    state = BrokerState.load(port)
    bootstrap = f"localhost:{port}"
    answering = port_open("127.0.0.1", port) and _metadata_ok(_probe(bootstrap, state))
    return {
        "bootstrap": bootstrap,
        "answering": answering,
        "managed": state is not None and _is_our_broker(state),
        "pid": state.pid if state else None,
        "data_dir": state.data_dir if state else None,
        "secure": bool(state and state.secure),
    }
