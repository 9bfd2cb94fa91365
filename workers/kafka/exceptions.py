"""Errors of the Kafka plumbing.

RolloutError
└── KafkaPlumbingError
    ├── KafkaUnavailableError     the cluster cannot be reached (retryable)
    ├── MissingTopicsError        topics a command needs do not exist (and may not be created)
    └── DeliveryError             the broker did not acknowledge an output
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = ["DeliveryError", "KafkaPlumbingError", "KafkaUnavailableError", "MissingTopicsError"]


class KafkaPlumbingError(RolloutError):
    """Something between the pipeline and the Kafka cluster failed."""


class KafkaUnavailableError(KafkaPlumbingError):
    """The cluster cannot be reached; retrying later may help."""


class DeliveryError(KafkaPlumbingError):
    """The broker did not acknowledge a produced message."""


class MissingTopicsError(KafkaPlumbingError):
    """Topics a command needs are not on the cluster; `topics` names them."""

    def __init__(self, message: str, *, topics: list[str]) -> None:
        super().__init__(message)
        self.topics = topics
