"""docker-compose.yml cannot run here (no image registry): keep it correct by reading it.

Every command of a service built from the Dockerfile is parsed by the CLI's own parser, so an
unknown command or flag fails here; dependencies, volumes, the Prometheus targets and the
Grafana dashboard are checked against the services and the fixed metric names.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.cli.main import build_parser
from pipeline.config import load_config
from pipeline.observe.scrape import COMPOSE_SERVICES
from tests import ROOT
from workers.metrics import NAMES

COMPOSE = ROOT / "docker-compose.yml"


def test_kafka_service_is_a_kraft_single_node() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] == "CONTROLLER"
    node = env["KAFKA_NODE_ID"]
    voter_id, _, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].partition("@")
    assert int(voter_id) == node
    # Every listener named is mapped to a protocol, and the controller's port is a listener.
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    listeners = {
        item.split("://")[0]: item.split(":")[-1] for item in env["KAFKA_LISTENERS"].split(",")
    }
    assert set(listeners) <= set(protocols)
    assert listeners["CONTROLLER"] == voter.split(":")[1]
    for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","):
        assert item.split("://")[0] in listeners
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in listeners
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == 1
    published = [p.split(":")[0] for p in kafka["ports"]]
    assert "9092" in published


# --- the pipeline's services --------------------------------------------------------------

ROOT = COMPOSE.parent
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS = ROOT / "infra" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "infra" / "grafana"
METRICS_PORT = 9400

#: The metric names the dashboard may use: exactly what the processes export.
METRICS = frozenset(NAMES)
#: Shown on the dashboard; the rest (replica queue gauges, the replica's version) are for
#: ad-hoc use.
SHOWN = METRICS - {
    "rollout_replica_running_requests",
    "rollout_replica_waiting_requests",
    "rollout_replica_policy_version",
}
HISTOGRAMS = frozenset(
    {
        "rollout_turn_latency_seconds",
        "rollout_trajectory_latency_seconds",
        "rollout_staleness",
    }
)


def _services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def _built() -> dict[str, dict[str, Any]]:
    """The services built from the Dockerfile (entrypoint `rollout`)."""
    return {name: svc for name, svc in _services().items() if "build" in svc}


def _args(service: dict[str, Any]) -> argparse.Namespace:
    command = service["command"]
    assert isinstance(command, list), "use the exec form (a list) so the test can parse it"
    argv = [str(part) for part in command]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`rollout {' '.join(argv)}`: {stderr.getvalue().strip()}")
    # argparse accepts unambiguous abbreviations; a compose file should spell flags out.
    flags = _option_strings(_parser())
    for flag in (part.partition("=")[0] for part in argv if part.startswith("--")):
        assert flag in flags, f"`{flag}` is not a full flag name"
    return args


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()  # parse_args leaves the parser as it was: one serves every test


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


def _depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _one_shot(service: dict[str, Any]) -> bool:
    return str(service.get("restart", "no")) == "no"


def _is_replica(args: argparse.Namespace) -> bool:
    return args.command == "replica" and args.action == "serve"


def _metrics_port(args: argparse.Namespace) -> int | None:
    """Where a process serves /metrics: replicas on their HTTP port, the rest on --metrics-port."""
    if _is_replica(args):
        return int(args.port)
    port = getattr(args, "metrics_port", None)
    return int(port) if port else None


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path → source (named volume or host path) of each of a service's volumes."""
    out = {}
    for item in service.get("volumes", []):
        source, target = item.split(":")[:2]
        out[target] = source
    return out


@pytest.mark.parametrize("name", sorted(_built()))
def test_every_command_is_one_the_cli_accepts(name: str) -> None:
    args = _args(_built()[name])
    assert callable(args.handler)


def test_the_pipeline_services_are_all_there() -> None:
    commands = {name: _args(svc) for name, svc in _built().items()}
    kinds = sorted(
        " ".join(
            str(part)
            for part in (args.command, getattr(args, "action", None), getattr(args, "stage", None))
            if part
        )
        for args in commands.values()
    )
    assert kinds == sorted(
        [
            "topics create",
            "model init",
            "replica serve",
            "replica serve",
            "replica sync",
            "replica sync",
            "worker agent-loop",
            "worker reward",
            "worker replay",
            "train",
        ]
    )
    replicas = [args for args in commands.values() if _is_replica(args)]
    assert all(args.backend == "hf" and args.register for args in replicas)
    assert len({args.replica_id for args in replicas}) == len(replicas)
    assert "replicas" in _services()["agent-loop"]["deploy"]
    assert {"prometheus", "grafana"} <= set(_services())


def test_every_service_reaches_the_broker_and_loads_its_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    advertised = _services()["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    for name, service in _built().items():
        env = service["environment"]
        assert env["ROLLOUT_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:19092", name
        assert f"//{env['ROLLOUT_KAFKA__BOOTSTRAP_SERVERS']}" in advertised
        # The environment is valid config (names exist, stages agree on staleness).
        for key in [k for k in os.environ if k.startswith("ROLLOUT_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        load_config()


def test_depends_on_names_existing_services_with_sound_conditions() -> None:
    services = _services()
    for name, service in services.items():
        for dep, condition in _depends_on(service).items():
            assert dep in services, f"{name} depends on unknown service {dep!r}"
            assert dep != name
            if _one_shot(services[dep]) and "build" in services[dep]:
                assert condition == "service_completed_successfully", (name, dep)
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
            assert condition in {
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            }
    # Every stage waits for its topics; the one-shots finish instead of restarting.
    for name, service in _built().items():
        if not _one_shot(service):
            deps = _depends_on(service)
            assert "topics" in deps or any("topics" in _depends_on(services[d]) for d in deps), name


def test_checkpoints_and_model_are_on_the_shared_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    built = _built()
    trainer = built["trainer"]
    for key, value in trainer["environment"].items():
        monkeypatch.setenv(key, str(value))
    checkpoints = load_config().trainer.checkpoint_dir
    named = set(yaml.safe_load(COMPOSE.read_text())["volumes"])

    def volume_for(service: dict[str, Any], path: str) -> str:
        for target, source in _mounts(service).items():
            if path == target or path.startswith(target.rstrip("/") + "/"):
                return source
        pytest.fail(f"{path} is on no volume")

    shared = volume_for(trainer, checkpoints)
    assert shared in named
    assert volume_for(trainer, _args(trainer).model) == shared
    for name, service in built.items():
        args = _args(service)
        if _is_replica(args):
            # The trainer publishes checkpoint paths; the replica loads that same path.
            assert volume_for(service, checkpoints) == shared, name
            assert volume_for(service, args.model) == shared, name
    assert volume_for(built["model-init"], _args(built["model-init"]).out) == shared


def test_every_process_serves_metrics_and_prometheus_scrapes_them_all() -> None:
    services = _services()
    exporters: dict[str, int] = {}
    for name, service in _built().items():
        args = _args(service)
        port = _metrics_port(args)
        if _one_shot(service):
            continue
        assert port is not None, f"{name} serves no metrics (add --metrics-port {METRICS_PORT})"
        if not _is_replica(args):
            assert port == METRICS_PORT, name
        exporters[name] = port

    scraped: dict[str, int] = {}
    config = yaml.safe_load(PROMETHEUS.read_text())
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                scraped[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            for host in dns["names"]:
                scraped[host] = int(dns["port"])
    for host, port in scraped.items():
        assert host in services, f"Prometheus scrapes unknown service {host!r}"
        assert exporters.get(host) == port, f"{host} serves metrics on {exporters.get(host)}"
    assert set(exporters) == set(scraped), "every exporting service is scraped"
    # A scaled service has several containers behind one name: DNS discovery finds them all.
    dns_names = {
        host
        for job in config["scrape_configs"]
        for dns in job.get("dns_sd_configs", [])
        for host in dns["names"]
    }
    scaled = {name for name, svc in services.items() if "deploy" in svc}
    assert scaled <= dns_names


def _process_name(args: argparse.Namespace) -> str:
    """The name `StagePlan` gives the process a compose command runs."""
    if _is_replica(args):
        return str(args.replica_id)
    if args.command == "replica":  # sync: named after the replica it keeps current
        return "sync-" + args.replica.rpartition("//")[2].split(":")[0].rpartition("-")[2]
    return "train" if args.command == "train" else str(args.stage)


def test_the_scrape_sources_services_are_the_compose_services() -> None:
    running = {
        name: _process_name(_args(svc)) for name, svc in _built().items() if not _one_shot(svc)
    }
    assert running == COMPOSE_SERVICES


def test_prometheus_and_grafana_files_are_mounted() -> None:
    services = _services()
    for name in ("prometheus", "grafana"):
        for source in _mounts(services[name]).values():
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    prometheus_mounts = _mounts(services["prometheus"])
    assert Path(prometheus_mounts["/etc/prometheus/prometheus.yml"]) == Path(
        "./infra/prometheus/prometheus.yml"
    )

    grafana = _mounts(services["grafana"])
    provisioning = ROOT / grafana["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (datasource,) = sources["datasources"]
    host, port = datasource["url"].removeprefix("http://").split(":")
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    for provider_file in (provisioning / "dashboards").glob("*.yml"):
        for provider in yaml.safe_load(provider_file.read_text())["providers"]:
            folder = provider["options"]["path"]
            assert folder in grafana, f"dashboards path {folder} is not mounted"
            assert list((ROOT / grafana[folder]).glob("*.json"))
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    folder, _, file = home.rpartition("/")
    assert (ROOT / grafana[folder] / file).is_file()


def _dashboard() -> dict[str, Any]:
    (path,) = (GRAFANA / "dashboards").glob("*.json")
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def _metric_names(expr: str) -> set[str]:
    names = set()
    for token in re.findall(r"\brollout_[A-Za-z0-9_:]*", expr):
        for suffix in ("_bucket", "_sum", "_count"):
            if token.endswith(suffix) and token.removesuffix(suffix) in HISTOGRAMS:
                token = token.removesuffix(suffix)
        names.add(token)
    return names


def test_dashboard_uses_only_the_fixed_metric_names() -> None:
    dashboard = _dashboard()
    sources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uid = sources["datasources"][0]["uid"]
    used: set[str] = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, f"{panel['title']}: {target['expr']} names no rollout_ metric"
            assert names <= METRICS, f"{panel['title']}: unknown {sorted(names - METRICS)}"
            for name in names & HISTOGRAMS:
                assert f"{name}_bucket" in target["expr"] or f"{name}_sum" in target["expr"]
            used |= names
    assert used >= SHOWN, f"no panel shows {sorted(SHOWN - used)}"


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (stage, le) "
        "(rate(rollout_staleness_bucket[$__rate_interval]))) / rollout_messages_consumed_total"
    )
    assert _metric_names(expr) == {"rollout_staleness", "rollout_messages_consumed_total"}
    assert _metric_names("rollout_policy_version_count") == {"rollout_policy_version_count"}


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            steps.append((instruction.upper(), rest.strip()))
    return steps


def test_dockerfile_builds_the_cli_from_the_repository() -> None:
    steps = _dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    entrypoint = [json.loads(rest) for kind, rest in steps if kind == "ENTRYPOINT"]
    assert entrypoint == [["rollout"]]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rollout"] == "pipeline.cli.main:main"
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = set()
    for kind, rest in steps:
        if kind == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert not source.startswith("--"), "no COPY --from: one stage"
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert source not in ignored, f"COPY {source}: excluded by .dockerignore"
                copied.add(source.rstrip("/"))
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top_level = {pattern.rstrip("*") for pattern in packages["packages"]["find"]["include"]}
    assert top_level <= copied, "every package of the distribution is copied"
    assert {"pyproject.toml", "README.md"} <= copied
    assert any(kind == "RUN" and "pip install" in rest for kind, rest in steps)
    java = re.compile(r"\b(openjdk|jdk|jre|java)\b", re.I)
    assert not any(java.search(rest) for kind, rest in steps if kind == "RUN"), "no Java"
