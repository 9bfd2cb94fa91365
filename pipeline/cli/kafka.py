"""`rollout kafka …` and `rollout topics …`: the local broker and the pipeline's topics."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.common import port, print_json
from pipeline.config import ConfigError, RunConfig

__all__ = ["add_parsers"]


# --- kafka ---------------------------------------------------------------------------


def cmd_kafka_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.broker.local import start_broker

    port = args.port or cfg.local_kafka.port
    if args.brokers != 1:
        return _cluster_up(args, cfg, port)
    state = start_broker(
        port,
        args.data_dir or cfg.local_kafka.data_dir,
        heap=cfg.local_kafka.heap,
        advertised_host=cfg.local_kafka.advertised_host,
        secure=args.secure,
        users=args.user or (),
    )
    if state.reused:
        print(f"Kafka already running at {state.bootstrap}", file=sys.stderr)
    if state.secure:
        print(
            f"SASL_SSL (SCRAM-SHA-512) with ACLs; credentials (0600) in "
            f"{Path(state.data_dir) / 'credentials.json'}; config for a user: "
            f"rollout kafka creds --port {port} --user NAME",
            file=sys.stderr,
        )
    print(state.bootstrap)
    return 0


def _cluster_up(args: argparse.Namespace, cfg: RunConfig, port: int) -> int:
    from pipeline.broker.cluster import start_cluster

    if args.secure:
        raise ConfigError("--secure is for one broker; a cluster is PLAINTEXT for now")
    if args.brokers < 3:
        raise ConfigError("--brokers: 1 (one broker) or 3 and more (a cluster with failover)")
    state = start_cluster(
        port,
        args.brokers,
        args.data_dir or cfg.local_kafka.data_dir,
        heap=cfg.local_kafka.cluster_heap,
    )
    if state.reused:
        print(f"Kafka cluster already running at {state.bootstrap}", file=sys.stderr)
    print(state.bootstrap)
    return 0


def cmd_kafka_creds(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.broker import access as kafka_access
    from pipeline.broker import secure as kafka_secure

    port = args.port or cfg.local_kafka.port
    data = kafka_secure.data_dir_for(port, args.data_dir or cfg.local_kafka.data_dir)
    bootstrap = f"localhost:{port}"
    if args.user not in kafka_secure.load_credentials(data).users:
        creds, added = kafka_secure.ensure_credentials(data, [args.user])
        admin = kafka_secure.client_config(bootstrap, data, kafka_secure.ADMIN_USER)
        kafka_access.ensure_users(admin, creds, added)
        print(f"created user {args.user} (no ACLs yet: rollout kafka grant)", file=sys.stderr)
    if args.password:
        print(kafka_secure.load_credentials(data).password(args.user))
    else:
        sys.stdout.write(kafka_secure.config_snippet(bootstrap, data, args.user, port=port))
    return 0


def cmd_kafka_grant(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.broker import access as kafka_access
    from pipeline.broker import secure as kafka_secure

    port = args.port or cfg.local_kafka.port
    data = kafka_secure.data_dir_for(port, args.data_dir or cfg.local_kafka.data_dir)
    admin = kafka_secure.client_config(f"localhost:{port}", data, kafka_secure.ADMIN_USER)
    names = [cfg.topics.name(t) if t in cfg.topics.ROLES else t for t in args.topic or []]
    count = kafka_access.grant(
        admin,
        args.user,
        topics=names,
        operations=args.op or ("read", "write", "describe"),
        group=args.group,
        prefixed=args.prefixed,
    )
    print(f"granted {count} ACLs to User:{args.user}")
    return 0


def cmd_kafka_down(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.broker.cluster import find_cluster, stop_cluster
    from pipeline.broker.local import stop_broker

    port = args.port or cfg.local_kafka.port
    if (cluster := find_cluster(port)) is not None:
        stop_cluster(cluster.port, purge=args.purge)
        print(f"Kafka cluster at {cluster.bootstrap}: stopped")
        return 0
    stopped = stop_broker(port, purge=args.purge)
    print(f"Kafka on port {port}: {'stopped' if stopped else 'was not running (not ours)'}")
    return 0


def cmd_kafka_status(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.broker.cluster import cluster_status, find_cluster
    from pipeline.broker.local import broker_status

    port = args.port or cfg.local_kafka.port
    if (cluster := find_cluster(port)) is not None:
        status = cluster_status(cluster)
        print_json(status)
        return 0 if all(b["registered"] for b in status["brokers"]) else 1
    status = broker_status(port)
    print_json(status)
    return 0 if status["answering"] else 1


# --- topics --------------------------------------------------------------------------


def cmd_topics(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline import topics

    if args.action == "create":
        replication, min_isr, brokers = topics.replication(cfg.kafka, cfg.topics)
        print(
            f"replication {replication}, min.insync.replicas {min_isr} "
            f"({brokers} broker{'s' if brokers != 1 else ''})",
            file=sys.stderr,
        )
        for name, outcome in topics.create_topics(cfg.kafka, cfg.topics).items():
            print(f"{name}\t{outcome}")
    elif args.action == "describe":
        for row in topics.describe_topics(cfg.kafka, cfg.topics):
            print_json(row)
    else:
        for name in topics.delete_topics(cfg.kafka, cfg.topics):
            print(f"{name}\tdeleted")
    return 0


PORT_HELP = "The local broker's port (default: local_kafka.port)."
DATA_DIR_HELP = "The broker's data directory (default: local_kafka.data_dir, one per port)."


def add_parsers(sub: Any) -> None:
    kafka = sub.add_parser("kafka", help="Local Apache Kafka broker (KRaft, no Docker).")
    ksub = kafka.add_subparsers(dest="action", required=True)
    up = ksub.add_parser(
        "up", help="Start (or reuse) the local broker; prints the bootstrap address."
    )
    up.add_argument("--port", type=port, help=PORT_HELP + " With --brokers N: the first's.")
    up.add_argument("--data-dir", help=DATA_DIR_HELP)
    up.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="1 (default) or a cluster of 3+ (KRaft combined nodes on ports PORT, PORT+1, …).",
    )
    up.add_argument(
        "--secure", action="store_true", help="SASL_SSL (SCRAM-SHA-512 over TLS) with ACLs."
    )
    up.add_argument(
        "--user", action="append", help="With --secure: a SCRAM user to create (repeat)."
    )
    up.set_defaults(handler=cmd_kafka_up)
    creds = ksub.add_parser(
        "creds", help="Secure broker: a user's `kafka:` config (creating the user if new)."
    )
    creds.add_argument("--port", type=port, help=PORT_HELP)
    creds.add_argument("--data-dir", help=DATA_DIR_HELP)
    creds.add_argument("--user", default="admin", help="The SCRAM user (default: admin).")
    creds.add_argument(
        "--password",
        action="store_true",
        help="Print only the password, e.g. for export ROLLOUT_KAFKA__SASL_PASSWORD=$(…).",
    )
    creds.set_defaults(handler=cmd_kafka_creds)
    grant = ksub.add_parser("grant", help="Secure broker: allow a user topics and a group.")
    grant.add_argument("--port", type=port, help=PORT_HELP)
    grant.add_argument("--data-dir", help=DATA_DIR_HELP)
    grant.add_argument("--user", required=True, help="The SCRAM user to grant to.")
    grant.add_argument(
        "--topic", action="append", help="Topic name or role (prompts, replay, …); repeat."
    )
    grant.add_argument(
        "--op",
        action="append",
        choices=["read", "write", "describe", "create", "delete", "alter", "describe_configs"],
        help="Operation on the topics (repeat); default read, write, describe.",
    )
    grant.add_argument("--group", help="Consumer group the user may join (READ).")
    grant.add_argument("--prefixed", action="store_true", help="Names are prefixes.")
    grant.set_defaults(handler=cmd_kafka_grant)
    down = ksub.add_parser("down", help="Stop the broker (or every broker) `up` started.")
    down.add_argument("--port", type=port, help=PORT_HELP)
    down.add_argument("--purge", action="store_true", help="Delete its data directory too.")
    down.set_defaults(handler=cmd_kafka_down)
    status = ksub.add_parser(
        "status", help="Is the local broker answering? (A cluster: each broker, what it leads.)"
    )
    status.add_argument("--port", type=port, help=PORT_HELP)
    status.set_defaults(handler=cmd_kafka_status)

    topics = sub.add_parser("topics", help="Create, describe or delete the pipeline's topics.")
    tsub = topics.add_subparsers(dest="action", required=True, metavar="{create,describe,delete}")
    for action, what in (
        ("create", "Create the run's topics (those that exist are left as they are)."),
        ("describe", "Each topic of the run: partitions, replication and configs (JSON lines)."),
        ("delete", "Delete the run's topics, and everything in them."),
    ):
        tsub.add_parser(action, help=what).set_defaults(handler=cmd_topics)
