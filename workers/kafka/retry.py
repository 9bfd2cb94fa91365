"""Asking the cluster again when the answer failed for a reason that passes: `call_retrying`,
`retrying`.

A broker lost mid-run makes some requests fail that would succeed a few seconds later: its
connections are refused, its partitions have no leader until the controller fences it
(`NOT_LEADER_OR_FOLLOWER`, `LEADER_NOT_AVAILABLE`), a group's coordinator moves
(`NOT_COORDINATOR`, `COORDINATOR_LOAD_IN_PROGRESS`), a request times out on a frozen broker.
The client libraries retry most of these inside produce, fetch and commit; what they hand back
as they are (an admin request sent to a dead node, an offsets lookup past its deadline) is
asked again here, every `BACKOFF_S`, until `within_s` has passed. Only errors the libraries
mark `retriable`, connection errors and timeouts are transient (`is_transient`): any other
error (authorization, a missing topic, a fenced producer) is raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiokafka.errors as aio_errors
import kafka.errors as errors

__all__ = ["BACKOFF_S", "RETRY_WITHIN_S", "call_retrying", "is_transient", "retrying"]

log = logging.getLogger("rollout.kafka.retry")

T = TypeVar("T")

#: Long enough for a broker's fencing, an election and a coordinator's load, with margin.
RETRY_WITHIN_S = 120.0
BACKOFF_S = 0.5

_TRANSIENT = (
    errors.KafkaConnectionError,
    errors.KafkaTimeoutError,
    errors.NodeNotReadyError,
    aio_errors.KafkaConnectionError,
    aio_errors.KafkaTimeoutError,
    aio_errors.NodeNotReadyError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` may pass once the cluster has moved leaders or coordinators."""
    if isinstance(exc, _TRANSIENT):
        return True
    kafka_error = isinstance(exc, (errors.KafkaError, aio_errors.KafkaError))
    return kafka_error and bool(getattr(exc, "retriable", False))


def call_retrying(fn: Callable[[], T], what: str, within_s: float = RETRY_WITHIN_S) -> T:
    """`fn()`, called again on a transient error until `within_s` has passed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() > deadline:
                raise
            log.info("%s: %r; asking again", what, exc)
        time.sleep(BACKOFF_S)


async def retrying(
    fn: Callable[[], Awaitable[T]], what: str, within_s: float = RETRY_WITHIN_S
) -> T:
    """`await fn()`, awaited again on a transient error until `within_s` has passed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await fn()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() > deadline:
                raise
            log.info("%s: %r; asking again", what, exc)
        await asyncio.sleep(BACKOFF_S)
