"""The CLI against the real broker: kafka up/status/down, topics, produce, consume."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from pipeline.data.arithmetic import arithmetic_rows, write_rows
from tests.conftest import free_port, run_cli

pytestmark = pytest.mark.kafka


def _three_free_ports() -> int:
    """A port P with P, P+1 and P+2 all free a moment ago."""
    import socket

    for _ in range(100):
        first = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", first + 1))
                b.bind(("127.0.0.1", first + 2))
        except OSError:
            continue
        return first
    raise RuntimeError("no three consecutive free ports")


@pytest.mark.long
def test_kafka_up_brokers_3_is_a_cluster_status_lists_each_broker_and_down_stops_all(
    tmp_path,
) -> None:
    port = _three_free_ports()
    env = {"ROLLOUT_HOME": str(tmp_path / "home")}
    up = run_cli("kafka", "up", "--brokers", "3", "--port", str(port), env=env, timeout=300)
    bootstrap = ",".join(f"localhost:{port + i}" for i in range(3))
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == bootstrap
        again = run_cli("kafka", "up", "--brokers", "3", "--port", str(port), env=env)
        assert again.returncode == 0 and "already running" in again.stderr

        flags = ("--bootstrap", bootstrap, "--set", "topics.prefix=cl.")
        created = run_cli(*flags, "topics", "create", env=env)
        assert created.returncode == 0, created.stderr
        assert "replication 3, min.insync.replicas 2 (3 brokers)" in created.stderr
        described = [
            json.loads(line) for line in run_cli(*flags, "topics", "describe").stdout.splitlines()
        ]
        assert {(d["replication"], d["min.insync.replicas"]) for d in described} == {(3, "2")}

        status = run_cli("kafka", "status", "--port", str(port + 1), env=env)  # any member
        assert status.returncode == 0, status.stdout
        brokers = json.loads(status.stdout)["brokers"]
        assert [b["node"] for b in brokers] == [1, 2, 3]
        assert all(b["registered"] and b["running"] for b in brokers)
        # every partition of the run's topics is led by exactly one broker
        led = [p for b in brokers for p in b["leads"].get("cl.turns", [])]
        assert sorted(led) == [0, 1, 2, 3]
        assert json.loads(status.stdout)["under_replicated_partitions"] == 0
    finally:
        down = run_cli("kafka", "down", "--port", str(port), env=env, timeout=120)
    assert down.returncode == 0 and "stopped" in down.stdout
    after = run_cli("kafka", "status", "--port", str(port), env=env)
    assert after.returncode == 1 and json.loads(after.stdout)["answering"] is False


def test_kafka_up_is_idempotent_and_down_stops_it(tmp_path) -> None:
    port = free_port()
    env = {"ROLLOUT_HOME": str(tmp_path / "home")}
    data = str(tmp_path / "data")
    up = run_cli("kafka", "up", "--port", str(port), "--data-dir", data, env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"localhost:{port}"
        assert "Kafka up at" in up.stderr and "s (pid" in up.stderr  # the time it took

        again = run_cli("kafka", "up", "--port", str(port), "--data-dir", data, env=env)
        assert again.returncode == 0 and "already running" in again.stderr

        status = run_cli("kafka", "status", "--port", str(port), env=env)
        assert status.returncode == 0
        assert json.loads(status.stdout) | {"pid": 0} == json.loads(status.stdout) | {"pid": 0}
        assert json.loads(status.stdout)["answering"] is True
        assert json.loads(status.stdout)["managed"] is True

        if shutil.which("kcat"):
            listing = subprocess.run(
                ["kcat", "-b", f"localhost:{port}", "-L"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert listing.returncode == 0 and "1 brokers" in listing.stdout
    finally:
        down = run_cli("kafka", "down", "--port", str(port), env=env)
    assert down.returncode == 0 and "stopped" in down.stdout
    after = run_cli("kafka", "status", "--port", str(port), env=env)
    assert after.returncode == 1 and json.loads(after.stdout)["answering"] is False


def test_topics_produce_and_consume(kafka_bootstrap, tmp_path, unique) -> None:
    prefix = unique("cli") + "."
    flags = ["--bootstrap", kafka_bootstrap, "--set", f"topics.prefix={prefix}"]
    created = run_cli(*flags, "topics", "create")
    assert created.returncode == 0, created.stderr
    assert "replication 1, min.insync.replicas 1 (1 broker)" in created.stderr
    assert f"{prefix}prompts\tcreated" in created.stdout
    assert f"{prefix}policy\tcreated" in created.stdout

    described = [
        json.loads(line) for line in run_cli(*flags, "topics", "describe").stdout.splitlines()
    ]
    by_role = {row["role"]: row for row in described}
    assert by_role["policy"]["cleanup.policy"] == "compact"
    assert by_role["replicas"]["cleanup.policy"] == "compact"
    assert by_role["turns"]["cleanup.policy"] == "delete"
    assert int(by_role["turns"]["max.message.bytes"]) >= 8 * 1024 * 1024

    rows = arithmetic_rows(12, seed=3)
    path = tmp_path / "data.jsonl"
    write_rows(rows, path)
    with path.open("a") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"prompt": [], "data_source": "openai/gsm8k"}) + "\n")
    produced = run_cli(*flags, "produce", "--dataset", str(path), "--quiet")
    assert produced.returncode == 0, produced.stderr
    assert json.loads(produced.stdout.splitlines()[-1])["sent"] == 12
    assert "skipped 2 invalid rows" in produced.stderr
    assert "row 13: not valid JSON" in produced.stderr and "row 14: prompt" in produced.stderr

    consumed = run_cli(*flags, "consume", "--topic", "prompts", "--limit", "12", "--timeout", "30")
    assert consumed.returncode == 0, consumed.stderr
    events = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert sorted(e["uid"] for e in events) == sorted(r["uid"] for r in rows)

    if shutil.which("kcat"):
        raw = subprocess.run(
            ["kcat", "-b", kafka_bootstrap, "-C", "-t", f"{prefix}prompts", "-c", "1", "-e", "-q"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert json.loads(raw.stdout.splitlines()[0])["kind"] == "prompt"

    deleted = run_cli(*flags, "topics", "delete")
    assert f"{prefix}prompts\tdeleted" in deleted.stdout


def test_wrong_config_fails_at_start_naming_the_field() -> None:
    result = run_cli("--set", "kafka.bootstrap_servers=nohostport", "topics", "create")
    assert result.returncode == 2
    assert "kafka.bootstrap_servers" in result.stderr
