"""Errors of the replica layer.

RolloutError                        (schemas.errors)
└── ReplicaError                    anything a replica backend raises on purpose
    ├── BackendUnavailableError     unknown backend name, or its module failed to import
    ├── InvalidRequestError         a request the replica will not serve (→ HTTP 400)
    ├── WeightLoadError             a checkpoint that cannot be loaded (→ HTTP 400);
    │                               the live weights and version are left unchanged
    └── EngineClosedError           the engine was shut down (→ HTTP 503)
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = [
    "BackendUnavailableError",
    "EngineClosedError",
    "InvalidRequestError",
    "ReplicaError",
    "WeightLoadError",
]


class ReplicaError(RolloutError):
    """Root of the replica layer's errors."""


class BackendUnavailableError(ReplicaError):
    """The named backend is unknown or cannot be imported here (e.g. vllm not installed)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"replica backend {name!r} unavailable: {reason}")
        self.name = name
        self.reason = reason


class InvalidRequestError(ReplicaError):
    """A request that cannot be served as asked; `type` is the error type sent to the client."""

    def __init__(self, message: str, *, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.type = type


class WeightLoadError(ReplicaError):
    """A checkpoint that does not fit the served model (missing, unexpected or misshaped)."""


class EngineClosedError(ReplicaError):
    """The engine is closed; no new requests are accepted."""
