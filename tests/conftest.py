"""Shared fixtures: the real Kafka broker for the session, and per-test names.

The broker is started once per test session (only if a test asks for it) on a free port
with a temporary data directory, and stopped at the end. Set ROLLOUT_TEST_BOOTSTRAP to run
the suite against an existing cluster instead.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from workers.kafka.config import KafkaConfig, TopicsConfig

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    existing = os.environ.get("ROLLOUT_TEST_BOOTSTRAP")
    if existing:
        yield existing
        return
    from pipeline.kafka_local import start_broker, stop_broker

    home = tmp_path_factory.mktemp("rollout-home")
    os.environ["ROLLOUT_HOME"] = str(home)
    port = free_port()
    state = start_broker(port, home / "kafka", quiet=True)
    try:
        yield state.bootstrap
    finally:
        stop_broker(port, purge=True)


@pytest.fixture
def kafka_config(kafka_bootstrap: str) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=kafka_bootstrap)


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Names no other test uses: unique("group") -> "group-3f2a…"."""
    return lambda base: f"{base}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def topics_config(kafka_config: KafkaConfig, unique: Callable[[str], str]) -> TopicsConfig:
    """The pipeline's topics under a prefix of this test's own, created on the broker."""
    from pipeline.topics import create_topics

    topics = TopicsConfig(prefix=unique("t") + ".")
    create_topics(kafka_config, topics)
    return topics


@pytest.fixture
def topic_factory(kafka_config: KafkaConfig, unique: Callable[[str], str]) -> Callable[..., str]:
    """Create a fresh topic: topic_factory("name", partitions=1) -> its unique name."""
    from kafka.admin import NewTopic

    from workers.kafka.clients import make_admin

    def create(base: str = "topic", partitions: int = 1) -> str:
        name = unique(base)
        admin = make_admin(kafka_config)
        try:
            admin.create_topics([NewTopic(name, partitions, 1)], wait_for_metadata=True)
        finally:
            admin.close()
        return name

    return create


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `rollout …` as a real subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
        check=False,
    )
