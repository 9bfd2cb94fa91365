"""`rollout chaos`: the chaos suite (`make chaos`)."""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any

from pipeline.cli.options import add_options, options_from
from pipeline.config import ConfigError, RunConfig
from pipeline.harness.chaos.faults import CLUSTER_FAULTS, DEFAULT_FAULTS, parse_fault
from pipeline.harness.chaos.run import ChaosOptions, run_chaos
from workers.kafka.client_logs import route_client_logs


def add_parsers(sub: Any) -> None:
    parser = sub.add_parser(
        "chaos", help="Kill, stop and restart every stage; account for every sample."
    )
    parser.set_defaults(handler=cmd_chaos)
    add_options(parser, ChaosOptions)
    parser.add_argument(
        "--fault",
        action="append",
        dest="faults",
        metavar="FAULT",
        help=(
            f"kill:|term:|stop:<process> or broker (repeat); default: {' '.join(DEFAULT_FAULTS)}. "
            "With --brokers 3: kill:broker, stop:broker (the leader of most of rl.turns; "
            f"broker-N: node N), bounce:brokers; default {' '.join(CLUSTER_FAULTS)}"
        ),
    )
    parser.add_argument("--json", action="store_true", help="Print the report as JSON too.")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _faults(given: list[str] | None, *, existing: str | None, brokers: int = 1) -> tuple[str, ...]:
    """The run's faults, checked before anything starts (a bad one found by the schedule
    minutes in was a traceback). A broker the run does not own is never restarted: the
    default faults leave it out, and asking for it is refused. The broker faults of a cluster
    need `--brokers 3`; the one broker's restart is not one of them."""
    if brokers != 1 and (brokers < 3 or existing):
        why = "--brokers 3 starts the run's own cluster" if existing else "1 or 3 and more"
        raise ConfigError(f"--brokers: {why}")
    faults = tuple(given) if given else (CLUSTER_FAULTS if brokers >= 3 else DEFAULT_FAULTS)
    for text in faults:
        try:
            fault = parse_fault(text)
        except ValueError as exc:
            raise ConfigError(f"--fault: {exc}") from exc
        if fault.on_cluster and brokers < 3:
            raise ConfigError(f"--fault {text}: a broker of a cluster; run with --brokers 3")
        if fault.kind == "broker" and brokers >= 3:
            raise ConfigError("--fault broker restarts the one broker; a cluster has kill:broker")
    if existing and "broker" in faults:
        if given:
            raise ConfigError(
                "--fault broker restarts the run's own broker: not with --bootstrap-existing"
            )
        faults = tuple(f for f in faults if f != "broker")
    return faults


def _reachable(bootstrap: str) -> None:
    """A broker the run is given answers now, before the model is built, or one line says so."""
    from pydantic import ValidationError

    from workers.kafka.clients import make_admin
    from workers.kafka.config import KafkaConfig

    try:
        kafka = KafkaConfig(bootstrap_servers=bootstrap)
    except ValidationError as exc:
        raise ConfigError(f"--bootstrap-existing {bootstrap}: not host:port[,host:port]") from exc
    make_admin(kafka).close()


def cmd_chaos(args: argparse.Namespace, cfg: RunConfig) -> int:
    # SIGTERM unwinds like Ctrl-C: every stage and the run's broker are stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    # A broker restart makes kafka-python warn of every retried request: the faults are meant,
    # so its records show only with -v (the report accounts for every sample).
    route_client_logs(getattr(args, "verbose", 0))
    faults = _faults(args.faults, existing=args.existing, brokers=args.brokers)
    if args.existing:
        _reachable(args.existing)
    opts = options_from(args, ChaosOptions, faults=faults)
    report = run_chaos(opts)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "table"}))
    print(f"faults fired: {', '.join(f['fault'] for f in report['faults_fired']) or 'none'}")
    if report["faults_not_fired"]:
        print(f"faults NOT fired: {', '.join(report['faults_not_fired'])}")
    print(f"restarts by the supervisor: {report['restarts'] or 'none'}")
    for fault in report["faults_fired"]:
        if "stall_s" in fault:
            stalled = ", ".join(f"{stage} {s:.1f}" for stage, s in fault["stall_s"].items())
            print(
                f"  {fault['fault']} at {fault['at_s']} s ({fault['seconds']} s): stall s {stalled}"
            )
    if report["samples_added"]:
        pending_at = f"{100 * opts.topup_share:.0f}%"
        print(f"samples added for faults still pending at {pending_at}: {report['samples_added']}")
    for reason, count in report["stale_reasons"].items():
        print(f"  stale {count:5d} samples: {reason}")
    print(
        f"stale share: {100 * report['stale_share']:.1f}% "
        f"(at most {100 * opts.max_stale_share:.0f}%)"
    )
    print(f"run: {report['run_dir']} ({report['wall_s']} s)")
    print(report["table"])
    return 0 if report["ok"] else 1
