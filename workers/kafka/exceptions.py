"""Errors of the Kafka plumbing.

RolloutError
└── KafkaPlumbingError
    ├── KafkaUnavailableError     the cluster cannot be reached (retryable)
    └── DeliveryError             the broker did not acknowledge an output
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = ["DeliveryError", "KafkaPlumbingError", "KafkaUnavailableError"]


class KafkaPlumbingError(RolloutError):
    """Something between the pipeline and the Kafka cluster failed."""


class KafkaUnavailableError(KafkaPlumbingError):
    """The cluster cannot be reached; retrying later may help."""


class DeliveryError(KafkaPlumbingError):
    """The broker did not acknowledge a produced message."""
