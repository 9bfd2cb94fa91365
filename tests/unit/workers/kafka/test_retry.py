"""Which errors a broker's loss makes transient, and asking again for them only."""

from __future__ import annotations

import aiokafka.errors as aio_errors
import kafka.errors as errors
import pytest

from workers.kafka import retry
from workers.kafka.retry import call_retrying, is_transient


def test_a_moved_leader_or_coordinator_and_a_dead_node_are_transient() -> None:
    assert is_transient(errors.NotLeaderForPartitionError())
    assert is_transient(aio_errors.NotCoordinatorError())
    assert is_transient(aio_errors.CoordinatorLoadInProgressError())
    assert is_transient(errors.KafkaConnectionError("refused"))
    assert is_transient(aio_errors.KafkaTimeoutError())
    assert not is_transient(errors.TopicAuthorizationFailedError())
    assert not is_transient(aio_errors.CommitFailedError())
    assert not is_transient(ValueError("no"))


def test_call_retrying_asks_again_until_it_passes_and_raises_the_rest(monkeypatch) -> None:
    monkeypatch.setattr(retry, "BACKOFF_S", 0.0)
    answers = iter([errors.NotLeaderForPartitionError(), errors.KafkaConnectionError(), 7])

    def ask() -> int:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert call_retrying(ask, "test") == 7
    with pytest.raises(errors.TopicAuthorizationFailedError):
        call_retrying(lambda: (_ for _ in ()).throw(errors.TopicAuthorizationFailedError()), "t")
    with pytest.raises(errors.KafkaConnectionError):
        call_retrying(lambda: (_ for _ in ()).throw(errors.KafkaConnectionError()), "t", 0.0)
