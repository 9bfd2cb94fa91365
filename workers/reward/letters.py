"""Dead letters of the reward stage (`schemas.deadletter` headers, stage `reward`).

- a turn that does not decode, or a trajectory that cannot be assembled: the original
  record's key and bytes, with its topic/partition/offset;
- a trajectory that cannot be scored (scorer error or timeout, unknown data_source): key
  uid, value the whole trajectory as a `ScoredTrajectory` tagged `reward_failed` (so it can
  be re-scored from the dead letter alone), headers pointing at the turn that completed it;
- an abandoned trajectory (assembling, no new turn for `abandon_after_s`): one letter per
  turn it held, the turn's key and bytes as they arrived (offset -1: the table keeps the
  bytes, not where they were read).
"""

from __future__ import annotations

from typing import Any

from schemas.codec import encode, headers_for
from schemas.deadletter import DeadLetter
from schemas.events import ScoredTrajectory
from schemas.headers import TRAJECTORY_ID
from workers.reward.exceptions import RewardError

__all__ = ["STAGE", "abandoned_letter", "record_letter", "trajectory_letter"]

STAGE = "reward"


def record_letter(message: Any, exc: BaseException, value: bytes | None = None) -> DeadLetter:
    """A consumed record (an aiokafka `ConsumerRecord`) that could not be processed."""
    return DeadLetter.of_record(STAGE, message, exc, value=value)


def trajectory_letter(message: Any, tagged: ScoredTrajectory, exc: RewardError) -> DeadLetter:
    """A complete trajectory that could not be scored; `message` is its completing turn."""
    return DeadLetter(
        stage=STAGE,
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        error_class=getattr(exc, "error_class", type(exc).__name__),
        error_cause=exc.cause,
        error_message=str(exc),
        key=tagged.uid.encode(),
        value=encode(tagged),
        original_headers=[
            *headers_for(tagged),
            (TRAJECTORY_ID, tagged.trajectory_id.encode()),
        ],
    )


def abandoned_letter(
    topic: str, partition: int, key: bytes, value: bytes, reason: str
) -> DeadLetter:
    """One turn of an abandoned trajectory, as it arrived on `topic`[`partition`]."""
    return DeadLetter(
        stage=STAGE,
        topic=topic,
        partition=partition,
        offset=-1,
        error_class="AbandonedTrajectory",
        error_cause="abandoned",
        error_message=reason,
        key=key,
        value=value,
    )
