"""A faust-streaming `App` configured from `KafkaConfig`, the way every stream stage needs it.

`make_faust_app(kafka, app_id, ...)` returns an app whose clients connect with the same
bootstrap servers, security protocol, SASL and SSL settings as the rest of the pipeline
(`KafkaConfig.aiokafka_kwargs()` is the one source of them), and with the settings the
architecture's faust rules ask for:

- producer `acks=all` (faust's `producer_acks=-1`); faust flushes its producer before each
  offset commit, and the stages also await their own outputs before a batch's events are
  acknowledged, so an offset is never committed ahead of an unacknowledged output;
- no exactly-once processing guarantee (stages de-duplicate instead);
- offsets reset to `earliest` for a new group, so nothing produced before the first start
  is skipped;
- no web server and no topic auto-creation for source topics (the pipeline's admin creates
  them); faust still creates its own changelog topics, with the given replication factor.

The app id is also the consumer group id and the prefix of the changelog topics
(`{app_id}-{table}-changelog`). Importing this module imports faust; stage configs must not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import faust

from workers.kafka.config import KafkaConfig

__all__ = [
    "StallGuard",
    "faust_broker_credentials",
    "faust_broker_url",
    "make_faust_app",
    "run_faust_app",
]

log = logging.getLogger("rollout.kafka.faust")


def faust_broker_url(kafka: KafkaConfig) -> str:
    """`kafka://host1:9092;host2:9092` — faust's spelling of the bootstrap list."""
    return "kafka://" + ";".join(kafka.bootstrap_servers)


def faust_broker_credentials(kafka: KafkaConfig) -> faust.types.auth.CredentialsT | None:
    """SASL/SSL settings of `kafka` as faust credentials (None for PLAINTEXT)."""
    kwargs = kafka.aiokafka_kwargs()
    protocol = kafka.security_protocol
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(kwargs["ssl_context"])
    return faust.SASLCredentials(
        username=kwargs["sasl_plain_username"],
        password=kwargs["sasl_plain_password"],
        mechanism=kwargs["sasl_mechanism"],
        ssl_context=kwargs.get("ssl_context"),
    )


def make_faust_app(
    kafka: KafkaConfig,
    app_id: str,
    *,
    data_dir: str | Path,
    replication_factor: int = 1,
    commit_interval_s: float = 2.8,
    **settings: Any,
) -> faust.App:
    """A faust app for one stream stage; `settings` override any faust setting."""
    conf: dict[str, Any] = {
        "broker": faust_broker_url(kafka),
        "broker_credentials": faust_broker_credentials(kafka),
        "broker_client_id": f"{kafka.client_id}-{app_id}",
        "broker_request_timeout": max(kafka.request_timeout_ms / 1000.0, 90.0),
        "broker_commit_interval": commit_interval_s,
        "producer_acks": -1,
        "producer_max_request_size": kafka.max_request_size,
        "consumer_max_fetch_size": kafka.max_request_size,
        "consumer_auto_offset_reset": "earliest",
        "processing_guarantee": "at_least_once",
        "topic_replication_factor": replication_factor,
        "topic_disable_leader": True,
        "store": "memory://",
        "datadir": str(data_dir),
        "web_enabled": False,
        "key_serializer": "raw",
        "value_serializer": "raw",
    }
    conf.update(settings)
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    log.info("faust app %s on %s (%s)", app_id, kafka.bootstrap, kafka.security_protocol)
    return faust.App(app_id, **conf)


def run_faust_app(app: faust.App) -> int:
    """Run a stage's app in this process until it stops; its exit status.

    Logging stays as the process set it up (faust neither reconfigures it nor redirects stdout).
    """
    worker = faust.Worker(
        app,
        loglevel=logging.getLogger().getEffectiveLevel(),
        quiet=True,
        override_logging=False,
        redirect_stdouts=False,
    )
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


class StallGuard:
    """Re-seek a stage's source partitions when its committed offsets stop moving.

    faust-streaming drops records that its fetcher reads while flow is suspended (during a
    rebalance: the delivery to the stream is abandoned but the read offset still moves on),
    and never fetches them again. The stage then never acknowledges them, so the committed
    offset of that partition stays put below its end for good; seen in the chaos suite after
    a broker restart and after a restart of the stage. Nothing is lost (those records are
    not committed), but nothing moves either. The guard watches for exactly that state — a
    source partition with records past its committed offset, and that offset unchanged for
    `stall_s` — and seeks every partition back to its committed offset, so the records are
    fetched and delivered again (the stages de-duplicate: a redelivery is harmless).
    """

    def __init__(self, app: faust.App, topics: set[str], stall_s: float) -> None:
        self.app, self.topics, self.stall_s = app, topics, stall_s
        self.busy = False  # a batch is being processed: never seek under it
        self.reseeks = 0
        self._since: dict[Any, tuple[int | None, float]] = {}  # tp → (committed, unchanged since)

    def stuck(self, now: float) -> dict[Any, tuple[int | None, int]]:
        """Source partitions behind their end whose committed offset has not moved for
        `stall_s`: tp → (committed, end)."""
        consumer = self.app.consumer
        out: dict[Any, tuple[int | None, int]] = {}
        for tp in consumer.assignment():
            if tp.topic not in self.topics:
                continue
            end = consumer.highwater(tp)
            committed = consumer._committed_offset.get(tp)  # faust keeps no public accessor
            seen, since = self._since.get(tp, (None, now))
            if committed != seen or tp not in self._since:
                self._since[tp] = (committed, now)
                continue
            behind = end is not None and end - (committed if committed is not None else -1) > 1
            if behind and now - since >= self.stall_s:
                out[tp] = (committed, end)
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.stall_s / 4))
            if self.busy:
                continue
            now = time.monotonic()
            stuck = self.stuck(now)
            if not stuck:
                continue
            self.reseeks += 1
            log.warning(
                "committed offsets of %s have not moved for %.0fs with records past them; "
                "seeking back to the committed offsets (re-seek %d)",
                ", ".join(f"{tp.topic}[{tp.partition}] {c}..{e}" for tp, (c, e) in stuck.items()),
                self.stall_s,
                self.reseeks,
            )
            await self.app.consumer.perform_seek()
            self._since.clear()
