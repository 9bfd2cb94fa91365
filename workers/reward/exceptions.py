"""Errors of the reward stage.

    RolloutError
    └── RewardError
        ├── ScorerError                 a scorer raised; carries the original class name
        │   ├── ScorerTimeout           a scorer exceeded its per-item timeout
        │   ├── ScorerCrashed           a pool worker died while scoring
        │   ├── RewardModelError        the /classify endpoint failed or answered badly
        │   └── JudgeError              the judge's replicas could not give a verdict
        │       └── VerdictError        the judge answered, but no verdict could be parsed
        └── UnknownDataSource           no scorer for the trajectory's data_source

Every one of them sends the trajectory to the dead-letter topic (or, with
`on_failure='score'`, to `rl.scored` with the failure score and a tag); `cause` is the short
machine-readable reason written into the dead letter's headers. A `VerdictError` always takes
the second way (`reward.judge.failure_score`, tagged): the trajectory is sound, the judge's
answer is not, and the count of them (`unparseable_verdicts`) says how often.
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = [
    "JudgeError",
    "RewardError",
    "RewardModelError",
    "ScorerCrashed",
    "ScorerError",
    "ScorerTimeout",
    "UnknownDataSource",
    "VerdictError",
]


class RewardError(RolloutError):
    """Root of the reward stage's errors."""

    cause = "reward_error"


class ScorerError(RewardError):
    """A scorer raised; `error_class` names what it raised."""

    cause = "scorer_error"

    def __init__(self, message: str, *, error_class: str | None = None) -> None:
        super().__init__(message)
        self.error_class = error_class or type(self).__name__


class ScorerTimeout(ScorerError):
    """A scorer ran past its timeout (its pool worker was killed, if it had one)."""

    cause = "scorer_timeout"

    def __init__(self, message: str, *, timeout_s: float) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


class ScorerCrashed(ScorerError):
    """A pool worker exited while scoring (the item may have killed it)."""

    cause = "scorer_crashed"


class RewardModelError(ScorerError):
    """The reward model's /classify failed or its answer does not fit the request."""

    cause = "reward_model"


class JudgeError(ScorerError):
    """No verdict came back from the judge's replicas (none routable, retries used up, its
    timeout)."""

    cause = "judge"


class VerdictError(JudgeError):
    """The judge answered, and its answer holds no verdict the configured parser reads;
    `answer` is what it said."""

    cause = "unparseable_verdict"

    def __init__(self, message: str, *, answer: str) -> None:
        super().__init__(message)
        self.answer = answer


class UnknownDataSource(RewardError):
    """No custom function, no reward model, and no rule scorer for this data_source."""

    cause = "unknown_data_source"

    def __init__(self, data_source: str) -> None:
        super().__init__(f"no scorer for data_source {data_source!r}")
        self.data_source = data_source
