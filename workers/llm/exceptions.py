"""Errors of the LLM router and client.

    RolloutError (schemas.errors)
    └── LLMError                          every error of workers.llm
        ├── ReplicaError                  one replica failed one request (retryable)
        │   ├── ReplicaUnavailableError   connection refused / reset / closed mid-response
        │   ├── ReplicaServerError        5xx, 408 or 429, or a 200 that breaks the contract
        │   └── ReplicaTimeoutError       no response within the request timeout
        ├── BadRequestError               4xx: the request itself is wrong; never retried
        ├── NoReplicaError                no routable replica (within the wait, for the client)
        ├── RetriesExhaustedError         bounded retries used up; carries the last error
        ├── GenerationTimeoutError        one generation ran past its total wall-time cap
        └── ClientClosedError             the client is not open

`RETRYABLE_ERRORS` names what the client retries (with backoff, on the same replica if it is
still healthy, else another). Errors that end a generation early carry what was generated so
far (`partial`), so a caller can log or salvage it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.errors import RolloutError

if TYPE_CHECKING:
    from workers.llm.contract import GenerateOutput

__all__ = [
    "RETRYABLE_ERRORS",
    "BadRequestError",
    "ClientClosedError",
    "GenerationTimeoutError",
    "LLMError",
    "NoReplicaError",
    "ReplicaError",
    "ReplicaServerError",
    "ReplicaTimeoutError",
    "ReplicaUnavailableError",
    "RetriesExhaustedError",
]


class LLMError(RolloutError):
    """Root of the errors of `workers.llm`."""


class ReplicaError(LLMError):
    """A replica failed to serve one request; another try may succeed."""

    def __init__(self, message: str, *, replica_id: str = "", status: int | None = None) -> None:
        super().__init__(f"[{replica_id}] {message}" if replica_id else message)
        self.replica_id = replica_id
        self.status = status
        self.server_message = message


class ReplicaUnavailableError(ReplicaError):
    """Could not connect, or the connection broke before a full response."""


class ReplicaServerError(ReplicaError):
    """5xx (or 408/429 overload), or a response that does not follow the contract."""


class ReplicaTimeoutError(ReplicaError):
    """The replica did not answer within the request timeout."""


class BadRequestError(LLMError):
    """A 4xx: the server refused the request itself (bad parameter, prompt past the context).

    Carries the server's message and error type; retrying would fail the same way.
    """

    def __init__(
        self, message: str, *, status: int, error_type: str = "", replica_id: str = ""
    ) -> None:
        super().__init__(f"{status} from replica {replica_id or '?'}: {message}")
        self.status = status
        self.error_type = error_type
        self.replica_id = replica_id
        self.server_message = message


class NoReplicaError(LLMError):
    """No replica can take a request (none registered, or all unhealthy)."""


class RetriesExhaustedError(LLMError):
    """The bounded retries of one generation are used up; `last_error` says why."""

    def __init__(
        self, message: str, *, last_error: BaseException | None, partial: GenerateOutput | None
    ) -> None:
        super().__init__(message)
        self.last_error = last_error
        self.partial = partial


class GenerationTimeoutError(LLMError):
    """One generation ran past `max_total_time_s`; `partial` holds the tokens so far."""

    def __init__(self, message: str, *, partial: GenerateOutput | None) -> None:
        super().__init__(message)
        self.partial = partial


class ClientClosedError(LLMError):
    """The client was used before `start()` or after `close()`."""


RETRYABLE_ERRORS: tuple[type[ReplicaError], ...] = (
    ReplicaUnavailableError,
    ReplicaServerError,
    ReplicaTimeoutError,
)
