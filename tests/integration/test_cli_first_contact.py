"""Every mistake a newcomer makes with `rollout` is one clear line within seconds, no traceback.

Each case runs the real CLI as a subprocess and asserts its exit status, a time bound and
that nothing on its output is a traceback or a Kafka client's own log record. The cases:
no broker at the address, a broker without the run's topics, a missing model directory, a
dataset with bad rows, a bad config value, and Ctrl-C in the middle of a run.

BOUND is generous for a loaded two-core machine (Python and its imports take a few seconds)
and still well under what each case took before: 30 s of kafka-python retries for an
unreachable broker, 60 s of metadata retries for a missing topic, a model load and a 30 s
wait for a trainer or a replica sync without topics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.data.arithmetic import arithmetic_rows, write_rows
from tests.conftest import REPO, free_port
from workers.kafka.config import TopicsConfig

BOUND_S = 20.0
FIX_TOPICS = "`rollout topics create`"


@dataclass
class Run:
    code: int
    seconds: float
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        """What the user reads on stderr (progress bars and blank lines aside)."""
        return [line for line in self.stderr.splitlines() if line.strip()]


def rollout(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> Run:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        check=False,
    )
    return Run(proc.returncode, time.monotonic() - started, proc.stdout, proc.stderr)


def assert_one_line(run: Run, code: int, *needles: str, bound_s: float = BOUND_S) -> None:
    """Exit `code` within `bound_s`, no traceback, and stderr one line holding `needles`."""
    shown = f"exit {run.code} after {run.seconds:.1f}s:\n{run.stderr[-3000:]}"
    assert run.code == code, shown
    assert run.seconds < bound_s, shown
    assert "Traceback" not in run.stderr + run.stdout, shown
    assert len(run.lines) == 1, shown
    for needle in needles:
        assert needle in run.lines[0], shown


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return write_rows(arithmetic_rows(3, seed=1), tmp_path / "d.jsonl")


# --- no broker at the address ---------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["topics", "describe"],
        ["topics", "create"],
        ["produce", "--dataset", "{dataset}"],
        ["consume"],
        ["replica", "sync", "--replica", "http://127.0.0.1:9"],
        ["worker", "replay"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_no_broker_is_one_line_after_the_bootstrap_timeout(command, dataset) -> None:
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    args = [part.replace("{dataset}", str(dataset)) for part in command]
    run = rollout("--bootstrap", bootstrap, *args)
    assert_one_line(run, 1, f"cannot reach Kafka at {bootstrap}", "rollout kafka up")


def test_the_bootstrap_timeout_is_configurable() -> None:
    bootstrap = f"127.0.0.1:{free_port()}"
    run = rollout(
        "--bootstrap", bootstrap, "--set", "kafka.bootstrap_timeout_ms=1000", "topics", "describe"
    )
    assert_one_line(run, 1, "no answer in 1 s", "kafka.bootstrap_timeout_ms", bound_s=10)


def test_verbose_shows_the_client_library_records() -> None:
    """The records hidden by default are there with -v: the hiding is what the tests above
    prove absent, not a broker that never logged."""
    bootstrap = f"127.0.0.1:{free_port()}"
    run = rollout(
        "-v",
        "--bootstrap",
        bootstrap,
        "--set",
        "kafka.bootstrap_timeout_ms=1000",
        "topics",
        "describe",
    )
    assert run.code == 1 and "Traceback" not in run.stderr
    assert any(" kafka." in line for line in run.lines), run.stderr[-2000:]


# --- a broker without the run's topics ----------------------------------------------


@pytest.fixture
def fresh(kafka_bootstrap: str, unique: Callable[[str], str]) -> list[str]:
    """Global flags for a run whose topics do not exist on the (real) broker."""
    return ["--bootstrap", kafka_bootstrap, "--set", f"topics.prefix={unique('fresh')}."]


@pytest.mark.kafka
def test_produce_creates_the_runs_topics_on_a_local_broker(fresh, dataset) -> None:
    run = rollout(*fresh, "produce", "--dataset", str(dataset), "--quiet")
    assert run.code == 0 and run.seconds < BOUND_S, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert json.loads(run.stdout.splitlines()[-1])["sent"] == 3
    prefix = fresh[-1].removeprefix("topics.prefix=")
    assert f"{prefix}prompts\tcreated" in run.stderr and f"{prefix}policy\tcreated" in run.stderr
    rows = [json.loads(line) for line in rollout(*fresh, "topics", "describe").stdout.splitlines()]
    assert all(row["exists"] for row in rows)


@pytest.mark.kafka
def test_produce_fails_at_once_when_creating_is_off(fresh, dataset) -> None:
    run = rollout(
        *fresh, "--set", "topics.create_missing=never", "produce", "--dataset", str(dataset)
    )
    assert_one_line(run, 1, "prompts not found", FIX_TOPICS)


@pytest.mark.kafka
@pytest.mark.parametrize(
    "command",
    [["consume"], ["replica", "sync", "--replica", "http://127.0.0.1:9"], ["worker", "replay"]],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_command_without_its_topics_names_the_fix(fresh, command) -> None:
    assert_one_line(rollout(*fresh, *command), 1, FIX_TOPICS)


@pytest.mark.kafka
def test_trainer_and_agent_loop_without_topics_say_so_before_loading(
    fresh, tiny_model, tmp_path
) -> None:
    train = rollout(
        *fresh,
        "--set",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
        "train",
        "--model",
        str(tiny_model),
    )
    assert_one_line(train, 1, FIX_TOPICS)
    agent = rollout(
        *fresh,
        "worker",
        "agent-loop",
        "--model",
        str(tiny_model),
        "--replica",
        f"http://127.0.0.1:{free_port()}",
    )
    assert_one_line(agent, 1, FIX_TOPICS)
    serve = rollout(
        *fresh,
        "replica",
        "serve",
        "--model",
        str(tiny_model),
        "--port",
        str(free_port()),
        "--register",
    )
    assert_one_line(serve, 1, FIX_TOPICS)


@pytest.mark.kafka
def test_status_of_a_run_without_topics_says_how_to_create_them(fresh) -> None:
    run = rollout(*fresh, "status", "--json", "--interval", "0.1")
    assert run.code == 0 and run.seconds < BOUND_S and "Traceback" not in run.stderr
    assert json.loads(run.stdout)["topics"] == {}
    assert len(run.lines) == 1 and FIX_TOPICS in run.lines[0]


# --- a missing model directory ------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["replica", "serve", "--model", "{missing}"],
        ["worker", "agent-loop", "--model", "{missing}", "--replica", "http://127.0.0.1:9"],
        ["--set", "reward.tokenizer={missing}", "worker", "reward"],
        ["up", "--ray", "--model", "{missing}"],  # before a Ray head is started
        ["bench", "agent-loop", "--model", "{missing}"],
        ["bench", "engine", "--model", "{missing}"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_missing_model_directory_is_one_line(command, tmp_path) -> None:
    missing = str(tmp_path / "no-model")
    run = rollout(
        "--bootstrap",
        f"127.0.0.1:{free_port()}",
        *[part.replace("{missing}", missing) for part in command],
    )
    assert_one_line(run, 2, missing, "does not exist", "rollout model init")


def test_a_directory_that_is_not_a_model_is_one_line(tmp_path) -> None:
    run = rollout("replica", "serve", "--model", str(tmp_path), "--port", str(free_port()))
    assert_one_line(run, 2, "holds no config.json")


@pytest.mark.kafka
def test_the_trainer_refuses_a_missing_model_directory(
    kafka_bootstrap, topics_config, tmp_path
) -> None:
    run = rollout(
        "--bootstrap",
        kafka_bootstrap,
        "--set",
        f"topics.prefix={topics_config.prefix}",
        "--set",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
        "train",
        "--model",
        str(tmp_path / "no-model"),
    )
    assert_one_line(run, 1, "no-model is not a model directory", "rollout model init")


def test_replica_serve_on_a_port_in_use_is_one_line(tiny_model) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = rollout("replica", "serve", "--model", str(tiny_model), "--port", str(port))
    assert_one_line(run, 2, f"cannot listen on 127.0.0.1:{port}")


# --- a dataset with bad rows --------------------------------------------------------


def test_bad_dataset_files_fail_before_kafka(tmp_path) -> None:
    """No broker listens: the dataset's own error comes first, so it was checked first."""
    no_broker = ["--bootstrap", f"127.0.0.1:{free_port()}"]
    bad_parquet = tmp_path / "x.parquet"
    bad_parquet.write_bytes(b"not parquet")
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    for path, needle in (
        (tmp_path / "none.jsonl", "does not exist"),
        (tmp_path, "is a directory"),
        (csv, "unsupported dataset format"),
        (bad_parquet, "not a readable parquet file"),
    ):
        run = rollout(*no_broker, "produce", "--dataset", str(path))
        assert_one_line(run, 1, needle, bound_s=10)


@pytest.mark.kafka
def test_a_dataset_without_one_valid_row_produces_nothing_and_says_so(fresh, tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{not json\n{"prompt": 3}\n')
    run = rollout(*fresh, "produce", "--dataset", str(path), "--quiet")
    assert run.code == 1 and run.seconds < BOUND_S and "Traceback" not in run.stderr
    assert "skipped row 1: not valid JSON" in run.stderr and "skipped row 2: prompt" in run.stderr
    assert run.lines[-1] == f"rollout: error: nothing produced: {path} has no valid row"
    assert sum("row 1:" in line for line in run.lines) == 1  # printed once, not also logged


def test_negative_limits_are_refused_by_the_parser(dataset) -> None:
    run = rollout("produce", "--dataset", str(dataset), "--limit", "-1")
    assert run.code == 2 and "Traceback" not in run.stderr
    assert "argument --limit: must be >= 0" in run.stderr


# --- a bad config value -------------------------------------------------------------


def test_bad_config_values_name_the_field(tmp_path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("kafka: [unclosed\n")
    run = rollout("--config", str(bad_yaml), "topics", "describe")
    assert_one_line(run, 2, "not valid YAML", "line 2, column 1", bound_s=10)
    run = rollout("--set", "kafka.bootstrap_servers=[1", "topics", "describe")
    assert_one_line(run, 2, "not a YAML value", bound_s=10)
    run = rollout("--set", "kafka.bootstrap_timeout_ms=soon", "topics", "describe")
    assert run.code == 2 and "Traceback" not in run.stderr
    assert "kafka.bootstrap_timeout_ms: Input should be a valid integer" in run.stderr
    run = rollout("--config", str(tmp_path / "missing.yaml"), "status")
    assert_one_line(run, 2, "does not exist", bound_s=10)


def test_bad_chaos_arguments_are_refused_before_it_starts() -> None:
    run = rollout("chaos", "--fault", "bogus")
    assert_one_line(run, 2, "bad fault 'bogus'", bound_s=10)
    no_broker = f"127.0.0.1:{free_port()}"
    run = rollout("chaos", "--bootstrap-existing", no_broker, "--fault", "broker")
    assert_one_line(run, 2, "not with --bootstrap-existing", bound_s=10)
    run = rollout("chaos", "--bootstrap-existing", no_broker)  # before the model is built
    assert_one_line(run, 1, f"cannot reach Kafka at {no_broker}")


# --- Ctrl-C in the middle of a run --------------------------------------------------


def interrupt(
    args: list[str],
    *,
    after: Callable[[subprocess.Popen[str]], bool],
    twice: bool = False,
    timeout_s: float = 120.0,
) -> Run:
    """Start `rollout *args`, send SIGINT once `after(proc)` holds (polled), return the run;
    `seconds` is from the (first) signal to the exit."""
    # SIGINT as a terminal's Ctrl-C delivers it: a run started in the background of a script
    # (a CI job started with `&`) inherits SIGINT ignored, and Python then leaves it ignored.
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli.main", *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not after(proc):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if twice:
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        return Run(proc.returncode, time.monotonic() - signalled, out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _after(seconds: float) -> Callable[[subprocess.Popen[str]], bool]:
    started = time.monotonic()
    return lambda proc: time.monotonic() - started > seconds


def _records_on(bootstrap: str, topic: str) -> Callable[[subprocess.Popen[str]], bool]:
    """True once `topic` holds a record (the command under test is producing)."""
    from kafka import KafkaConsumer, TopicPartition

    def flowing(proc: subprocess.Popen[str]) -> bool:
        consumer = KafkaConsumer(bootstrap_servers=bootstrap)
        try:
            parts = consumer.partitions_for_topic(topic) or set()
            ends = consumer.end_offsets([TopicPartition(topic, p) for p in parts])
            return sum(ends.values()) > 0
        finally:
            consumer.close()

    return flowing


def _samples_in_flight(port: int) -> Callable[[subprocess.Popen[str]], bool]:
    """True once the stage's /metrics shows work in flight (so a stop has to wait for it)."""
    import re
    import urllib.request

    def busy(proc: subprocess.Popen[str]) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        found = re.search(r"^rollout_in_flight_samples\{[^}]*\} (\S+)$", text, re.MULTILINE)
        return found is not None and float(found.group(1)) > 0

    return busy


@pytest.mark.kafka
def test_ctrl_c_while_producing_is_one_line(kafka_bootstrap, topics_config, tmp_path) -> None:
    path = write_rows(arithmetic_rows(200, seed=2), tmp_path / "many.jsonl")
    args = [
        "--bootstrap",
        kafka_bootstrap,
        "--set",
        f"topics.prefix={topics_config.prefix}",
        "produce",
        "--dataset",
        str(path),
        "--rate",
        "5",
        "--quiet",
    ]
    # Signal once records flow (a fixed delay could land in the start-up of a loaded machine).
    run = interrupt(args, after=_records_on(kafka_bootstrap, topics_config.name("prompts")))
    assert_one_line(run, 130, "rollout: interrupted", bound_s=10)


def _trainer_running(checkpoint_dir: Path) -> Callable[[subprocess.Popen[str]], bool]:
    """True once the trainer's step log has its `start` record (the loop runs)."""
    steplog = checkpoint_dir / "metrics.jsonl"
    return lambda proc: steplog.is_file() and '"event": "start"' in steplog.read_text()


def _torch_loading(proc: subprocess.Popen[str]) -> bool:
    """True once the process has torch mapped (it is importing it or loading the model)."""
    try:
        return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


def _train_args(bootstrap: str, topics: TopicsConfig, model: Path, checkpoints: Path) -> list[str]:
    return [
        "--bootstrap", bootstrap,
        "--set", f"topics.prefix={topics.prefix}",
        "--set", f"trainer.checkpoint_dir={checkpoints}",
        "train", "--model", str(model),
    ]  # fmt: skip


@pytest.mark.kafka
def test_ctrl_c_stops_the_trainer_with_its_result(
    kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    ck = tmp_path / "ck"
    args = _train_args(kafka_bootstrap, topics_config, tiny_model, ck)
    run = interrupt(args, after=_trainer_running(ck))
    shown = f"exit {run.code} after {run.seconds:.1f}s:\n{run.stderr[-3000:]}"
    assert run.code == 0 and run.seconds < BOUND_S, shown  # stopped by its stop event
    assert "Traceback" not in run.stderr + run.stdout, shown
    assert json.loads(run.stdout.splitlines()[-1])["stopped_by"] == "stop_event"


@pytest.mark.kafka
def test_ctrl_c_while_the_trainer_loads_its_model_is_one_line_at_once(
    kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    args = _train_args(kafka_bootstrap, topics_config, tiny_model, tmp_path / "ck")
    run = interrupt(args, after=_torch_loading)
    assert_one_line(run, 130, "rollout: interrupted", bound_s=10)
    assert not (tmp_path / "ck" / "metrics.jsonl").exists()  # it never started its loop


@pytest.mark.kafka
def test_ctrl_c_twice_aborts_the_agent_loop_at_once(
    kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    """The replica never answers, so the first Ctrl-C's grace period would run out; the
    second one ends the worker at once."""
    from pipeline.data.producer import PromptProducer
    from workers.kafka.config import KafkaConfig

    with PromptProducer(KafkaConfig(bootstrap_servers=kafka_bootstrap), topics_config) as p:
        p.produce_rows(arithmetic_rows(4, seed=3), uid_prefix="ctrl-c")
    metrics = free_port()
    args = [
        "--bootstrap", kafka_bootstrap,
        "--set", f"topics.prefix={topics_config.prefix}",
        "--set", "agent_loop.grace_period_s=60",
        "worker", "agent-loop",
        "--model", str(tiny_model),
        "--replica", f"http://127.0.0.1:{free_port()}",
        "--metrics-port", str(metrics),
    ]  # fmt: skip
    run = interrupt(args, after=_samples_in_flight(metrics), twice=True)
    shown = f"exit {run.code} after {run.seconds:.1f}s:\n{run.stderr[-3000:]}"
    assert run.code == 130 and run.seconds < BOUND_S, shown
    assert "Traceback" not in run.stderr, shown
    assert any(line.startswith("rollout: stopping: up to 60 s") for line in run.lines), shown
    assert run.lines[-1] == "rollout: aborted; unfinished prompts are redelivered", shown
