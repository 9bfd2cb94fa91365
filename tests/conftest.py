"""Shared fixtures: the real Kafka broker for the session, and per-test names.

The broker is started once per test session (only if a test asks for it) on a free port
with a temporary data directory, and stopped at the end. Set ROLLOUT_TEST_BOOTSTRAP to run
the suite against an existing cluster instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.launch.replicas import wait_healthy
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.ports import free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def rollout_home_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ROLLOUT_HOME, where the brokers it starts record themselves."""
    home = tmp_path_factory.mktemp("rollout-home")
    os.environ["ROLLOUT_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> Iterator[str]:
    """The session's broker: ROLLOUT_TEST_BOOTSTRAP, else one started here (a cluster of
    ROLLOUT_TEST_BROKERS brokers when that is 3 or more, else one broker)."""
    existing = os.environ.get("ROLLOUT_TEST_BOOTSTRAP")
    if existing:
        yield existing
        return
    if int(os.environ.get("ROLLOUT_TEST_BROKERS", "1")) >= 3:
        yield request.getfixturevalue("kafka_cluster").bootstrap
        return
    from pipeline.broker.local import start_broker, stop_broker

    home = request.getfixturevalue("rollout_home_dir")
    port = free_port()
    state = start_broker(port, home / "kafka", quiet=True)
    try:
        yield state.bootstrap
    finally:
        stop_broker(port, purge=True)


@pytest.fixture(scope="session")
def kafka_cluster(rollout_home_dir: Path) -> Iterator[Any]:
    """A real cluster of ROLLOUT_TEST_BROKERS (default 3) KRaft brokers, started once per
    session (only if a test asks for it): topics replicated 3, min.insync.replicas 2. Tests
    that kill or stop a broker ask for `whole_cluster`, which makes it whole again after."""
    from pipeline.broker.cluster import start_cluster, stop_cluster

    brokers = max(3, int(os.environ.get("ROLLOUT_TEST_BROKERS", "3")))
    ports = [free_port() for _ in range(brokers)]
    state = start_cluster(
        ports[0], brokers, rollout_home_dir / "cluster", ports=ports, heap="512m", quiet=True
    )
    try:
        yield state
    finally:
        stop_cluster(state.port, purge=True)


@pytest.fixture
def whole_cluster(kafka_cluster: Any) -> Iterator[Any]:
    """The session's cluster, every broker running and every replica in sync before and
    after the test (a broker the test killed is started again)."""
    from pipeline.broker.cluster import start_cluster
    from pipeline.broker.leaders import wait_in_sync

    def whole() -> None:
        start_cluster(kafka_cluster.port, len(kafka_cluster.ports), quiet=True)
        wait_in_sync(kafka_cluster.kafka(), timeout_s=180)

    whole()
    yield kafka_cluster
    whole()


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


ROLLOUT = (sys.executable, "-m", "pipeline.cli.main")
"""The `rollout` command, for tests that start a stage as a subprocess of their own."""


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run `rollout …` as a real subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [*ROLLOUT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
        check=False,
    )


# --- models and replicas --------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen2 model + tokenizer, built once per session."""
    from pipeline.harness.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`rollout model init --preset vl`: the tiny LLaVA with its processor."""
    from pipeline.harness.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("models") / "vl", preset="vl", seed=0)


@pytest.fixture(scope="session")
def family_model(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Callable[[str], Path]:
    """`family_model(name)`: the tiny model with a chat-format family's tokenizer and template
    (`rollout model init --template name`), built once per family per session."""
    from pipeline.harness.models.tiny import init_model

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family == "hermes":
            return Path(request.getfixturevalue("tiny_model"))
        if family not in built:
            out = tmp_path_factory.mktemp("models") / family
            built[family] = init_model(out, preset="tiny", seed=0, template=family)
        return built[family]

    return get


JUDGE_TEMPLATE = "Reference: {ground_truth}\nAnswer: {response}"
"""`reward.judge.template` of the `judge_model`'s warm start: short, so the warm start is too."""


@pytest.fixture(scope="session")
def judge_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after 200 supervised steps (`pipeline.harness.demo.judge.warm_judge`) on
    `JUDGE_TEMPLATE`'s prompts: it answers `Verdict: 0|1`, and `I cannot judge this.` to a
    reference answer of `?` (`UNJUDGEABLE`). Built once per session."""
    import torch

    from pipeline.harness.demo.judge import warm_judge
    from workers.reward.config import JudgeConfig

    out = tmp_path_factory.mktemp("models") / "judge"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warm_judge(out, JudgeConfig(template=JUDGE_TEMPLATE))
    finally:
        torch.set_num_threads(threads)
    return out


class ReplicaProcess:
    """A real `rollout replica serve --backend hf` subprocess on a free port."""

    def __init__(
        self,
        model: Path,
        replica_id: str,
        log_dir: Path,
        *extra: str,
        global_args: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.replica_id = replica_id
        self.address = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{replica_id}.log"
        argv = [
            sys.executable, "-m", "pipeline.cli.main", *global_args,
            "replica", "serve",
            "--backend", "hf",
            "--model", str(model),
            "--port", str(self.port),
            "--replica-id", replica_id,
            "--threads", "1",
            *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        alive = lambda: self.proc.poll() is None  # noqa: E731
        wait_healthy(self.address, alive, timeout_s, name=self.replica_id, log=self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def hf_replicas(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ReplicaProcess]]:
    """Two real hf replicas serving the tiny model, shared by the session's tests."""
    logs = tmp_path_factory.mktemp("replica-logs")
    replicas = [ReplicaProcess(tiny_model, f"hf-{i}", logs) for i in range(2)]
    try:
        for rep in replicas:
            rep.wait_healthy()
        yield replicas
    finally:
        for rep in replicas:
            rep.stop()
