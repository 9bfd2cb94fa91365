"""Every Kafka client of the pipeline, of both client libraries, is made here and only here.

- kafka-python (the trainer, the CLI and tools): `make_producer`, `make_consumer`, `make_admin`.
- aiokafka (the asyncio stages): `make_aio_producer`, `make_aio_consumer`, `make_aio_admin`.

Every setting is derived here from `KafkaConfig`, one way for both libraries:

- Connection and security (`connection_kwargs`, `aio_connection_kwargs`): the bootstrap
  servers, `request_timeout_ms`, SASL and TLS; kafka-python's clients also wait at most
  `bootstrap_timeout_ms` for their first broker.
- kafka-python's clients connect as they are made; when that times out on a cluster, each
  bootstrap server is tried alone (`_connect`): a frozen broker in the list must not keep a
  new client from the live ones.
- Producers are idempotent with `acks=all` (an output counts only once every in-sync replica
  has it), linger `LINGER_MS`, and send records as large as `max_request_size`. aiokafka's
  batch `BATCH_BYTES`: its 16 KiB default puts each trajectory or turn (10+ KB) in a batch
  of its own and crawls.
- A broker's loss is not an error (three brokers, topics replicated 3, `min.insync.replicas`
  2): a produce to a dead leader, `NOT_LEADER_OR_FOLLOWER` and `LEADER_NOT_AVAILABLE` are
  retried after a metadata refresh. kafka-python's producer retries without a count until
  `delivery_timeout_ms` (`KafkaConfig`, 120 s); aiokafka's idempotent producer never expires a
  batch that has a leader (it retries in sequence until acknowledged) and fails one only when
  its partition has had no leader for `request_timeout_ms` (30 s; an election takes the
  brokers' session timeout, 6 s on the local cluster). Both keep one sequence per partition, so
  a retried batch the old leader had written is not written twice. kafka-python's clients
  reconnect to a broker that comes back within `RECONNECT_BACKOFF_MAX_MS` (its 30 s default
  left a restarted leader unused for up to half a minute). Consumers follow moved leaders and
  coordinators by themselves; their commits retry every retriable error (a coordinator that
  moved or is loading) and fail only when the group has rebalanced.
- Consumers never auto-commit (each stage commits after the outputs a record caused are
  acknowledged), start at the earliest offset when nothing is committed, and fetch records
  as large as `max_request_size` (per partition; `FETCH_MAX_BYTES` or more per fetch).
- A group member given `session_timeout_s` (the stateful stages) derives its rebalance
  timeout (at least `MIN_REBALANCE_TIMEOUT_S`), its heartbeat (`HEARTBEATS_PER_SESSION` per
  session, at least `MIN_HEARTBEAT_S` apart) and keeps `MAX_POLL_INTERVAL_MS` between
  fetches before the group counts it gone.

`overrides` replace any of these for one client (a benchmark's batch size, a test's timeout).
The aiokafka clients are returned unstarted: the caller starts and stops them on its loop.
`tests/unit/test_layering.py` fails when any other module of `schemas/`, `workers/` or
`pipeline/` constructs one of the client classes itself.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.serializer import DefaultSerializer
from pydantic import SecretStr

from workers.kafka.config import KafkaConfig
from workers.kafka.exceptions import KafkaUnavailableError

__all__ = [
    "BATCH_BYTES",
    "FETCH_MAX_BYTES",
    "HEARTBEATS_PER_SESSION",
    "LINGER_MS",
    "MAX_POLL_INTERVAL_MS",
    "MIN_HEARTBEAT_S",
    "MIN_REBALANCE_TIMEOUT_S",
    "RECONNECT_BACKOFF_MAX_MS",
    "ack_wait_s",
    "aio_connection_kwargs",
    "connection_kwargs",
    "make_admin",
    "make_aio_admin",
    "make_aio_consumer",
    "make_aio_producer",
    "make_consumer",
    "make_producer",
]

LINGER_MS = 5
BATCH_BYTES = 1024 * 1024
FETCH_MAX_BYTES = 50 * 1024 * 1024  # Kafka's default fetch.max.bytes; raised for larger records
MAX_POLL_INTERVAL_MS = 600_000  # a stateful stage's batch (scoring, a table restore) may be slow
MIN_REBALANCE_TIMEOUT_S = 60.0
HEARTBEATS_PER_SESSION = 10
MIN_HEARTBEAT_S = 1.0
RECONNECT_BACKOFF_MAX_MS = 1000


# --- settings ---------------------------------------------------------------------------


def connection_kwargs(config: KafkaConfig) -> dict[str, Any]:
    """Connection settings for any kafka-python client (producer, consumer, admin)."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": list(config.bootstrap_servers),
        "security_protocol": config.security_protocol,
        "request_timeout_ms": config.request_timeout_ms,
        # Only a client's first connection waits this long; later reconnects (a broker
        # restart under a running stage) retry without a deadline.
        "bootstrap_timeout_ms": config.bootstrap_timeout_ms,
        "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
    }
    if config.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = config.sasl_mechanism
        kwargs["sasl_plain_username"] = config.sasl_username
        kwargs["sasl_plain_password"] = _reveal(config.sasl_password)
    if config.security_protocol.endswith("SSL"):
        kwargs["ssl_cafile"] = config.ssl_cafile
        kwargs["ssl_certfile"] = config.ssl_certfile
        kwargs["ssl_keyfile"] = config.ssl_keyfile
        kwargs["ssl_password"] = _reveal(config.ssl_password)
        kwargs["ssl_check_hostname"] = config.ssl_check_hostname
    return kwargs


def aio_connection_kwargs(config: KafkaConfig) -> dict[str, Any]:
    """The same settings in aiokafka's names (TLS as an `ssl.SSLContext`)."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": config.bootstrap,
        "security_protocol": config.security_protocol,
        "request_timeout_ms": config.request_timeout_ms,
    }
    if config.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = config.sasl_mechanism
        kwargs["sasl_plain_username"] = config.sasl_username
        kwargs["sasl_plain_password"] = _reveal(config.sasl_password)
    if config.security_protocol.endswith("SSL"):
        import ssl

        context = ssl.create_default_context(cafile=config.ssl_cafile)
        context.check_hostname = config.ssl_check_hostname
        if config.ssl_certfile:
            context.load_cert_chain(
                config.ssl_certfile, config.ssl_keyfile, _reveal(config.ssl_password)
            )
        kwargs["ssl_context"] = context
    return kwargs


def _producer_settings(config: KafkaConfig) -> dict[str, Any]:
    return {
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": LINGER_MS,
        "max_request_size": config.max_request_size,
    }


def _consumer_settings(config: KafkaConfig, group_id: str | None) -> dict[str, Any]:
    return {
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": config.max_request_size,
        "fetch_max_bytes": max(config.max_request_size, FETCH_MAX_BYTES),
    }


def _group_timeouts(session_timeout_s: float) -> dict[str, int]:
    """A group member's timeouts, all from its session timeout."""
    return {
        "session_timeout_ms": int(session_timeout_s * 1000),
        "rebalance_timeout_ms": int(max(session_timeout_s, MIN_REBALANCE_TIMEOUT_S) * 1000),
        "heartbeat_interval_ms": int(
            max(MIN_HEARTBEAT_S, session_timeout_s / HEARTBEATS_PER_SESSION) * 1000
        ),
        "max_poll_interval_ms": MAX_POLL_INTERVAL_MS,
    }


def _reveal(secret: SecretStr | None) -> str | None:
    return secret.get_secret_value() if secret is not None else None


# --- kafka-python -----------------------------------------------------------------------


def make_producer(
    config: KafkaConfig, *, name: str = "producer", **overrides: Any
) -> KafkaProducer:
    """An idempotent, acks=all producer of raw bytes (keys are str or bytes) that retries a
    record for `delivery_timeout_ms`."""
    kwargs: dict[str, Any] = {
        **connection_kwargs(config),
        **_producer_settings(config),
        "delivery_timeout_ms": config.delivery_timeout_ms,
        "client_id": f"{config.client_id}-{name}",
        "key_serializer": DefaultSerializer(),  # str keys as UTF-8, bytes as they are
        "allow_auto_create_topics": False,
    }
    kwargs.update(overrides)
    producer: KafkaProducer = _connect(KafkaProducer, (), kwargs, config, "producer")
    return producer


def make_consumer(
    config: KafkaConfig,
    *topics: str,
    group_id: str | None,
    name: str = "consumer",
    **overrides: Any,
) -> KafkaConsumer:
    """A consumer that never auto-commits, reading from the earliest offset by default."""
    kwargs: dict[str, Any] = {
        **connection_kwargs(config),
        **_consumer_settings(config, group_id),
        "client_id": f"{config.client_id}-{name}",
        "allow_auto_create_topics": False,
    }
    kwargs.update(overrides)
    consumer: KafkaConsumer = _connect(KafkaConsumer, topics, kwargs, config, "consumer")
    return consumer


def make_admin(config: KafkaConfig, *, name: str = "admin", **overrides: Any) -> KafkaAdminClient:
    """An admin client (it connects now: `KafkaUnavailableError` when no broker answers)."""
    kwargs: dict[str, Any] = {
        **connection_kwargs(config),
        "client_id": f"{config.client_id}-{name}",
    }
    kwargs.update(overrides)
    admin: KafkaAdminClient = _connect(KafkaAdminClient, (), kwargs, config, "admin client")
    return admin


def _connect(
    factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: KafkaConfig, what: str
) -> Any:
    """`factory(*args, **kwargs)`, a kafka-python client that connects as it is made. If its
    bootstrap times out and there are several servers, each is tried alone: a SIGSTOPped
    (frozen) broker accepts the TCP connection but never answers, and kafka-python waited on it
    for all of `bootstrap_timeout_ms` instead of asking the others."""
    try:
        return factory(*args, **kwargs)
    except KafkaTimeoutError as exc:
        last: KafkaError = exc
        servers = list(kwargs.get("bootstrap_servers") or [])
        for server in servers if len(servers) > 1 else []:
            try:
                return factory(*args, **{**kwargs, "bootstrap_servers": [server]})
            except KafkaError as again:
                last = again
        raise _unavailable(config, what, last) from last
    except KafkaError as exc:
        raise _unavailable(config, what, exc) from exc


def ack_wait_s(config: KafkaConfig) -> float:
    """How long to wait on a kafka-python record's future (or a flush): by then the producer
    has delivered the record or failed it (`delivery_timeout_ms`, which outlasts an election;
    a fixed 30 s did not outlast a frozen leader's request timeout and the election after)."""
    return config.delivery_timeout_ms / 1000 + 5.0


def _unavailable(config: KafkaConfig, client: str, exc: KafkaError) -> KafkaUnavailableError:
    """One line that names the address, the wait and what to do about it."""
    if isinstance(exc, KafkaTimeoutError):
        waited = config.bootstrap_timeout_ms / 1000
        return KafkaUnavailableError(
            f"cannot reach Kafka at {config.bootstrap} (no answer in {waited:g} s, "
            "kafka.bootstrap_timeout_ms); is a broker running there? "
            "`rollout kafka up` starts a local one"
        )
    return KafkaUnavailableError(f"cannot start a {client} for Kafka at {config.bootstrap}: {exc}")


# --- aiokafka (unstarted) ---------------------------------------------------------------


def make_aio_producer(config: KafkaConfig, *, client_id: str, **overrides: Any) -> AIOKafkaProducer:
    """An idempotent, acks=all aiokafka producer with `BATCH_BYTES` batches."""
    kwargs: dict[str, Any] = {
        **aio_connection_kwargs(config),
        **_producer_settings(config),
        "client_id": client_id,
        "max_batch_size": BATCH_BYTES,
    }
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)


def make_aio_consumer(
    config: KafkaConfig,
    *topics: str,
    group_id: str | None,
    client_id: str,
    session_timeout_s: float | None = None,
    **overrides: Any,
) -> AIOKafkaConsumer:
    """An aiokafka consumer (subscribed to `topics`, or to none: the caller assigns) that
    never auto-commits and starts at the earliest offset; a group member's timeouts follow
    from `session_timeout_s` when given (aiokafka's defaults otherwise)."""
    kwargs: dict[str, Any] = {
        **aio_connection_kwargs(config),
        **_consumer_settings(config, group_id),
        "client_id": client_id,
    }
    if session_timeout_s is not None:
        kwargs.update(_group_timeouts(session_timeout_s))
    kwargs.update(overrides)
    return AIOKafkaConsumer(*topics, **kwargs)


def make_aio_admin(config: KafkaConfig, *, client_id: str, **overrides: Any) -> AIOKafkaAdminClient:
    """An aiokafka admin client (offsets of consumer groups)."""
    kwargs: dict[str, Any] = {**aio_connection_kwargs(config), "client_id": client_id}
    kwargs.update(overrides)
    return AIOKafkaAdminClient(**kwargs)
