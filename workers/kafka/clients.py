"""Factories for kafka-python clients configured the pipeline's way.

Producers are idempotent with `acks=all` (the architecture's delivery rule: an output counts
only once the broker has acknowledged it on every in-sync replica). Consumers never
auto-commit: each stage commits offsets itself, after the outputs they caused are
acknowledged. Every client gets its connection and security settings from `KafkaConfig`.
"""

from __future__ import annotations

import logging
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.serializer import DefaultSerializer

from workers.kafka.config import KafkaConfig
from workers.kafka.exceptions import KafkaUnavailableError

__all__ = ["make_admin", "make_consumer", "make_producer"]

log = logging.getLogger("rollout.kafka")


def make_producer(
    config: KafkaConfig, *, name: str = "producer", **overrides: Any
) -> KafkaProducer:
    """An idempotent, acks=all producer of raw bytes (keys are str or bytes)."""
    kwargs: dict[str, Any] = {
        **config.client_kwargs(),
        "client_id": f"{config.client_id}-{name}",
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 5,
        "max_request_size": config.max_request_size,
        "key_serializer": DefaultSerializer(),  # str keys as UTF-8, bytes as they are
        "allow_auto_create_topics": False,
    }
    kwargs.update(overrides)
    try:
        return KafkaProducer(**kwargs)
    except KafkaError as exc:
        raise _unavailable(config, "producer", exc) from exc


def make_consumer(
    config: KafkaConfig,
    *topics: str,
    group_id: str | None,
    name: str = "consumer",
    **overrides: Any,
) -> KafkaConsumer:
    """A consumer that never auto-commits, reading from the earliest offset by default."""
    kwargs: dict[str, Any] = {
        **config.client_kwargs(),
        "client_id": f"{config.client_id}-{name}",
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": config.max_request_size,
        "fetch_max_bytes": max(config.max_request_size, 52_428_800),
        "allow_auto_create_topics": False,
    }
    kwargs.update(overrides)
    try:
        return KafkaConsumer(*topics, **kwargs)
    except KafkaError as exc:
        raise _unavailable(config, "consumer", exc) from exc


def make_admin(config: KafkaConfig, **overrides: Any) -> KafkaAdminClient:
    kwargs: dict[str, Any] = {**config.client_kwargs(), "client_id": f"{config.client_id}-admin"}
    kwargs.update(overrides)
    try:
        return KafkaAdminClient(**kwargs)
    except KafkaError as exc:
        raise _unavailable(config, "admin client", exc) from exc


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
