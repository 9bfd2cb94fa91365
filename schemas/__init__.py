"""Event models and the wire codec. Imports no stage, and never torch."""

from schemas.codec import decode, decode_as, encode, headers_for
from schemas.errors import DecodeError, RolloutError
from schemas.events import (
    SCHEMA_VERSION,
    ChatMessage,
    Event,
    ExtraFields,
    PolicyVersion,
    PromptEvent,
    ReplicaInfo,
    RewardModelSpec,
    ScoredTrajectory,
    TrainingGroup,
    TurnEvent,
    trajectory_id,
)

__all__ = [
    "SCHEMA_VERSION",
    "ChatMessage",
    "DecodeError",
    "Event",
    "ExtraFields",
    "PolicyVersion",
    "PromptEvent",
    "ReplicaInfo",
    "RewardModelSpec",
    "RolloutError",
    "ScoredTrajectory",
    "TrainingGroup",
    "TurnEvent",
    "decode",
    "decode_as",
    "encode",
    "headers_for",
    "trajectory_id",
]
