"""The secure local broker: SCRAM-SHA-512 over TLS with ACLs, reached from config alone.

One secure broker of this module's own (free port, temporary data dir), started by
`start_broker(secure=True)` and stopped at the end. What is checked:
- the admin (super user) creates the pipeline's topics and round-trips a message;
- secrets stay in 0600 files, the CA key is gone, nothing secret reaches the broker's log;
- clients without credentials (PLAINTEXT, TLS without SASL) or with a wrong password are
  refused;
- a user granted only `{prefix}prompts` (and its group) uses it but cannot read or write
  `{prefix}replay`, nor create topics;
- a stage configured only by YAML (from `rollout kafka creds`) + `ROLLOUT_KAFKA__SASL_PASSWORD`
  connects with kafka-python (producer, consumer, admin) and aiokafka (including the
  stages' changelog restore).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kafka.errors import KafkaError, TopicAuthorizationFailedError
from pydantic import SecretStr

from pipeline.broker import access as kafka_access
from pipeline.broker import secure as kafka_secure
from pipeline.broker.local import broker_status, start_broker, stop_broker
from pipeline.config import load_config
from pipeline.topics import create_topics
from tests.conftest import free_port, run_cli
from workers.kafka.clients import (
    make_admin,
    make_aio_consumer,
    make_aio_producer,
    make_consumer,
    make_producer,
)
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.exceptions import KafkaUnavailableError

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@dataclass(frozen=True)
class SecureBroker:
    port: int
    bootstrap: str
    data_dir: Path
    home: Path
    topics: TopicsConfig

    def config(self, user: str) -> KafkaConfig:
        return kafka_secure.client_config(self.bootstrap, self.data_dir, user)

    @property
    def env(self) -> dict[str, str]:
        return {"ROLLOUT_HOME": str(self.home)}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    root = tmp_path_factory.mktemp("secure-kafka")
    home, data = root / "home", root / "data"
    saved_home = os.environ.get("ROLLOUT_HOME")
    os.environ["ROLLOUT_HOME"] = str(home)
    port = free_port()
    try:
        state = start_broker(port, data, secure=True, users=["alice"], heap="512m", quiet=True)
        assert state.secure
        topics = TopicsConfig(prefix=f"sec{port}.")
        broker = SecureBroker(port, state.bootstrap, Path(state.data_dir), home, topics)
        outcome = create_topics(broker.config("admin"), topics)
        assert set(outcome.values()) == {"created"} and len(outcome) == len(topics.ROLES)
        yield broker
    finally:
        stop_broker(port, purge=True)
        if saved_home is None:
            os.environ.pop("ROLLOUT_HOME", None)
        else:
            os.environ["ROLLOUT_HOME"] = saved_home


def _consume(config: KafkaConfig, topic: str, group: str | None, until: bytes) -> list[bytes]:
    """Values of `topic` from the start up to `until` (all test messages share a key)."""
    consumer = make_consumer(config, topic, group_id=group)
    try:
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while until not in values and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                values += [r.value for r in records]
        if group is not None:
            consumer.commit()
        return values
    finally:
        consumer.close()


def _produce(config: KafkaConfig, topic: str, *values: bytes) -> None:
    producer = make_producer(config)
    try:
        for value in values:
            producer.send(topic, value, key=b"k").get(timeout=30)
    finally:
        producer.close()


def test_admin_creates_topics_and_round_trips_with_secrets_kept_private(
    broker: SecureBroker,
) -> None:
    admin = broker.config("admin")
    topic = broker.topics.name("turns")
    _produce(admin, topic, b"hello")
    assert _consume(admin, topic, None, b"hello") == [b"hello"]

    status = broker_status(broker.port)
    assert status["answering"] is True and status["secure"] is True

    data = broker.data_dir
    for private in ("credentials.json", "server.properties", "tls/broker.pem"):
        assert stat.S_IMODE((data / private).stat().st_mode) == 0o600, private
    assert sorted(p.name for p in (data / "tls").iterdir()) == ["broker.pem", "ca.pem"]
    assert not list(data.glob(".java-args-*"))  # the format's argument file is gone
    creds = kafka_secure.load_credentials(data)
    assert "admin" in repr(creds) and creds.password("admin") not in repr(creds)
    log_text = (data / "server.log").read_text(errors="replace")
    for secret in [*creds.users.values(), creds.key_password]:
        assert secret not in log_text
    assert creds.password("admin") not in repr(admin)


@pytest.mark.parametrize("how", ["plaintext", "tls-without-sasl", "wrong-password"])
def test_clients_without_valid_credentials_are_refused(
    broker: SecureBroker, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    alice = broker.config("alice")
    config = {
        "plaintext": KafkaConfig(bootstrap_servers=broker.bootstrap),
        "tls-without-sasl": KafkaConfig(
            bootstrap_servers=broker.bootstrap, security_protocol="SSL", ssl_cafile=alice.ssl_cafile
        ),
        "wrong-password": alice.model_copy(update={"sasl_password": SecretStr("not-it")}),
    }[how]
    caplog.set_level(logging.WARNING, logger="kafka")
    # A wrong password fails at the SASL step, which a loaded machine can take seconds to
    # reach (TLS + SCRAM): give it time, so the failure seen is the refusal, not a timeout.
    timeout_ms = 20_000 if how == "wrong-password" else 3000
    log = broker.data_dir / "server.log"
    seen = log.stat().st_size if log.exists() else 0
    with pytest.raises(KafkaUnavailableError):
        admin = make_admin(config, bootstrap_timeout_ms=timeout_ms, request_timeout_ms=timeout_ms)
        admin.close()
    if how == "wrong-password":
        # The broker refused the password (its log says so, whatever the client saw first:
        # the SASL error, or, on a loaded machine, the socket the broker closed after it).
        with log.open(errors="replace") as handle:
            handle.seek(seen)
            assert "invalid credentials" in handle.read(), caplog.text[-2000:]


def test_user_granted_prompts_cannot_touch_replay(broker: SecureBroker) -> None:
    admin, alice = broker.config("admin"), broker.config("alice")
    prompts, replay = broker.topics.name("prompts"), broker.topics.name("replay")
    group = f"alice-{broker.port}"
    count = kafka_access.grant(admin, "alice", topics=[prompts], group=group)
    assert count == 4  # read, write, describe on the topic + read on the group
    assert kafka_access.grant(admin, "alice", topics=[prompts], group=group) == 4  # idempotent

    _produce(alice, prompts, b"p1", b"p2")
    read = _consume(alice, prompts, group, b"p2")
    assert [v for v in read if v in (b"p1", b"p2")] == [b"p1", b"p2"]

    _produce(admin, replay, b"secret-group")
    with pytest.raises(TopicAuthorizationFailedError):
        _produce(alice, replay, b"forged")
    assert _consume(admin, replay, None, b"secret-group") == [
        b"secret-group"
    ]  # nothing forged got in

    consumer = make_consumer(alice, group_id=None)
    try:
        visible = consumer.topics()
        assert prompts in visible and replay not in visible
    finally:
        consumer.close()
    assert _read_replay_as(alice, replay, group) == []

    from kafka.admin import NewTopic

    client = make_admin(alice)
    try:
        with pytest.raises(KafkaError):  # TopicAuthorizationFailed / ClusterAuthorizationFailed
            client.create_topics([NewTopic(f"{broker.topics.prefix}mine", 1, 1)])
    finally:
        client.close()


def _read_replay_as(config: KafkaConfig, replay: str, group: str) -> list[bytes]:
    """What a subscribed kafka-python consumer of `replay` gets (it logs, never raises)."""
    consumer = make_consumer(config, replay, group_id=group)
    try:
        values: list[bytes] = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                values += [r.value for r in records]
        assert consumer.assignment() == set()
        return values
    finally:
        consumer.close()


def test_every_stage_connects_from_config_alone(
    broker: SecureBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, prompts = str(broker.port), broker.topics.name("prompts")
    # A user created at run time (AlterUserScramCredentials), its config from the CLI.
    snippet = run_cli("kafka", "creds", "--port", port, "--user", "carol", env=broker.env)
    assert snippet.returncode == 0, snippet.stderr
    assert "created user carol" in snippet.stderr
    assert "ROLLOUT_KAFKA__SASL_PASSWORD" in snippet.stdout
    password = run_cli(
        "kafka", "creds", "--port", port, "--user", "carol", "--password", env=broker.env
    ).stdout.strip()
    assert password and password not in snippet.stdout
    for grant in (["--topic", prompts], ["--group", "carol-", "--prefixed"]):
        out = run_cli("kafka", "grant", "--port", port, "--user", "carol", *grant, env=broker.env)
        assert out.returncode == 0 and "granted" in out.stdout, out.stderr
    up = run_cli("kafka", "up", "--secure", "--port", port, env=broker.env)
    assert up.returncode == 0 and up.stdout.strip() == broker.bootstrap
    assert "credentials.json" in up.stderr and password not in up.stdout + up.stderr

    path = tmp_path / "run.yaml"
    path.write_text(snippet.stdout)
    monkeypatch.setenv("ROLLOUT_KAFKA__SASL_PASSWORD", password)
    kafka = load_config(path).kafka
    assert kafka.security_protocol == "SASL_SSL" and kafka.sasl_username == "carol"
    assert kafka.sasl_password is not None and kafka.sasl_password.get_secret_value() == password

    # kafka-python: admin, producer, consumer
    admin = make_admin(kafka)
    try:
        assert prompts in admin.list_topics()
    finally:
        admin.close()
    _produce(kafka, prompts, b"from-kafka-python")
    assert _consume(kafka, prompts, "carol-kp", b"from-kafka-python")[-1] == b"from-kafka-python"

    # aiokafka (the stream stages' client), and a stage table's restore, from the same KafkaConfig
    got_aio, table = asyncio.run(_aiokafka_and_table(kafka, prompts))
    assert b"from-aiokafka" in got_aio
    assert table[b"k"] == b"from-aiokafka"  # the later of the two writes of key k


async def _aiokafka_and_table(
    kafka: KafkaConfig, topic: str
) -> tuple[list[bytes], dict[bytes, bytes]]:
    producer = make_aio_producer(kafka, client_id="carol-aio")
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"from-aiokafka", key=b"k")
    finally:
        await producer.stop()
    consumer = make_aio_consumer(kafka, topic, group_id="carol-aio", client_id="carol-aio")
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=10_000)
        got_aio = [r.value for records in batches.values() for r in records]
        while b"from-aiokafka" not in got_aio:
            got_aio.append((await asyncio.wait_for(consumer.getone(), 20)).value)
    finally:
        await consumer.stop()
    return got_aio, await _table_reads(kafka, topic)


async def _table_reads(kafka: KafkaConfig, topic: str) -> dict[bytes, bytes]:
    """What the stages' `ChangelogTable` restores from `topic` (every partition)."""
    from workers.kafka.changelog import ChangelogTable

    producer = make_aio_producer(kafka, client_id="carol-table")
    await producer.start()
    try:
        partitions = await producer.partitions_for(topic)
    finally:
        await producer.stop()
    table = ChangelogTable(kafka, topic, client_id="carol-table")
    await table.restore(partitions)
    return table.data


def test_credentials_file_is_reused_and_users_are_added(broker: SecureBroker) -> None:
    before = json.loads((broker.data_dir / "credentials.json").read_text())["users"]
    creds, added = kafka_secure.ensure_credentials(broker.data_dir, ["alice", "dave"])
    assert added == ("dave",)
    assert {u: creds.users[u] for u in before} == before  # existing passwords kept
    with pytest.raises(kafka_secure.SecureBrokerError):
        kafka_secure.ensure_credentials(broker.data_dir, ["bad name"])
