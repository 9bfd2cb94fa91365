"""Errors of the replica layer.

RolloutError                        (schemas.errors)
└── BackendError                    anything a replica backend raises on purpose (server side;
    │                               the client's view of a failing replica is
    │                               workers.llm.exceptions.ReplicaError)
    ├── BackendUnavailableError     unknown backend name, or its module failed to import
    ├── ReplicaStartError           the engine process did not start (its root cause said)
    ├── InvalidRequestError         a request the replica will not serve (→ HTTP 400)
    ├── EngineClosedError           the engine was shut down (→ HTTP 503)
    └── UpstreamError               the server behind an adapter (vLLM, SGLang) failed a call
                                    or answered outside the contract (→ HTTP 5xx)

Weights that cannot be loaded (`WeightLoadError`, `WeightTransferError`, → HTTP 400) are the
weights flow's errors: `workers.weights.exceptions`.
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "EngineClosedError",
    "InvalidRequestError",
    "ReplicaStartError",
    "UpstreamError",
]


class BackendError(RolloutError):
    """Root of the replica layer's errors."""


class BackendUnavailableError(BackendError):
    """The named backend is unknown or cannot be imported here (e.g. vllm not installed)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"replica backend {name!r} unavailable: {reason}")
        self.name = name
        self.reason = reason


class ReplicaStartError(BackendError):
    """The engine behind a replica (vLLM) exited or never became healthy while starting."""


class InvalidRequestError(BackendError):
    """A request that cannot be served as asked; `type` is the error type sent to the client."""

    def __init__(self, message: str, *, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.type = type


class EngineClosedError(BackendError):
    """The engine is closed; no new requests are accepted."""


class UpstreamError(BackendError):
    """The server behind a contract adapter failed a call, or answered outside what the
    backend relies on (→ HTTP 5xx)."""
