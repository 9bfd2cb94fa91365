"""The wire codec: every event round-trips; anything else is a DecodeError with a reason."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from schemas import (
    DecodeError,
    PolicyVersion,
    PromptEvent,
    ReplicaInfo,
    ScoredTrajectory,
    TrainingGroup,
    TurnEvent,
    decode,
    decode_as,
    encode,
    headers_for,
)
from schemas import headers as h
from schemas.arrays import pack, unpack


def make_events() -> list:
    prompt = PromptEvent(
        uid="u1",
        prompt=[{"role": "user", "content": "What is 2 + 2?"}],
        data_source="openai/gsm8k",
        reward_model={"ground_truth": "4"},
        extra_info={"index": 3, "tool_selection": ["calculator"]},
        agent_name="tool_agent",
        n=4,
    )
    turn0 = TurnEvent(
        trajectory_id="u1/0",
        uid="u1",
        sample_index=0,
        attempt_id="a1",
        turn_index=0,
        role="assistant",
        token_ids=[5, 6, 7],
        logprobs=[-0.5, -1.25, -0.125],
        min_global_steps=2,
        max_global_steps=3,
        prompt_ids=[1, 2, 3, 4],
        data_source="openai/gsm8k",
        reward_model={"ground_truth": "4"},
        extra_info={"index": 3},
    )
    tool_turn = TurnEvent(
        trajectory_id="u1/0",
        uid="u1",
        sample_index=0,
        attempt_id="a1",
        turn_index=1,
        role="tool",
        token_ids=[9, 9],
        min_global_steps=3,
        max_global_steps=3,
        final=True,
        num_turns=3,
        response_length=5,
        tool_reward=0.5,
        extra_fields={"min_global_steps": 2, "max_global_steps": 3},
    )
    scored = ScoredTrajectory(
        uid="u1",
        trajectory_id="u1/0",
        sample_index=0,
        attempt_id="a1",
        data_source="openai/gsm8k",
        prompt_ids=np.arange(4),
        response_ids=[5, 6, 7, 9, 9],
        response_mask=[1, 1, 1, 0, 0],
        response_logprobs=[-0.5, -1.25, -0.125, 0.0, 0.0],
        num_turns=3,
        reward_score=1.0,
        tool_rewards=[0.5],
        extra_fields={"min_global_steps": 2, "max_global_steps": 3},
    )
    group = TrainingGroup(
        uid="u1",
        samples=[scored],
        advantages=[0.0],
        min_global_steps=2,
        max_global_steps=3,
        emitted_at_version=4,
    )
    policy = PolicyVersion(version=4, path="/ckpt/step-4", groups_trained=16, samples_trained=64)
    replica = ReplicaInfo(replica_id="r0", address="http://127.0.0.1:8100", backend="hf", version=4)
    return [prompt, turn0, tool_turn, scored, group, policy, replica]


@pytest.mark.parametrize("event", make_events(), ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event) -> None:
    data = encode(event)
    back = decode(data)
    assert type(back) is type(event)
    assert back == event
    assert decode_as(data, type(event)) == event


def test_arrays_are_packed_little_endian_base64() -> None:
    scored = make_events()[3]
    obj = orjson.loads(encode(scored))
    raw = base64.b64decode(obj["response_ids"])
    assert np.frombuffer(raw, "<i4").tolist() == [5, 6, 7, 9, 9]
    assert np.frombuffer(base64.b64decode(obj["response_mask"]), "u1").tolist() == [1, 1, 1, 0, 0]
    assert np.frombuffer(base64.b64decode(obj["response_logprobs"]), "<f4")[1] == -1.25


def test_pack_unpack() -> None:
    values = np.array([0, 1, -5, 2**31 - 1], dtype=np.int32)
    assert unpack(pack(values, "<i4"), "<i4").tolist() == values.tolist()
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack(base64.b64encode(b"abc"), "<i4")


def test_headers_carry_kind_schema_and_versions() -> None:
    _prompt, turn0, _tool, scored, _group, policy, _replica = make_events()
    headers = dict(headers_for(turn0))
    assert headers[h.KIND] == b"turn"
    assert headers[h.SCHEMA] == b"1"
    assert (headers[h.MIN_VERSION], headers[h.MAX_VERSION]) == (b"2", b"3")
    assert dict(headers_for(scored))[h.MAX_VERSION] == b"3"
    assert dict(headers_for(policy))[h.MIN_VERSION] == b"4"


@pytest.mark.parametrize(
    ("value", "cause", "needle"),
    [
        (b"{not json", "json", "not valid JSON"),
        (b"[1, 2]", "shape", "JSON object"),
        (b'{"schema_version": 2, "kind": "prompt"}', "schema_version", "schema_version 2"),
        (b'{"kind": "prompt"}', "schema_version", "schema_version None"),
        (b'{"schema_version": 1, "kind": "bogus"}', "validation", "kind"),
        (b'{"schema_version": 1, "kind": "prompt", "uid": "x"}', "validation", "prompt"),
        (b"\xff\xfe\x00garbage", "json", "not valid JSON"),
        (None, "empty", "tombstone"),
    ],
)
def test_bad_values_raise_decode_error(value, cause, needle) -> None:
    with pytest.raises(DecodeError) as info:
        decode(value)
    assert info.value.cause == cause
    assert needle in str(info.value)


def test_wrong_types_and_inconsistencies_are_rejected() -> None:
    good = orjson.loads(encode(make_events()[3]))
    for change, needle in [
        ({"reward_score": "high"}, "reward_score"),
        ({"response_mask": pack(np.array([1, 1], dtype="u1"), "u1")}, "differ in length"),
        ({"trajectory_id": "u1/7"}, "trajectory_id"),
        ({"response_ids": "!!!not-base64"}, "response_ids"),
        ({"extra_fields": {"min_global_steps": 5, "max_global_steps": 3}}, "min_global_steps"),
        ({"surprise": 1}, "surprise"),
    ]:
        with pytest.raises(DecodeError, match=needle):
            decode(orjson.dumps({**good, **change}))


def test_decode_as_rejects_the_wrong_kind() -> None:
    with pytest.raises(DecodeError, match="expected TurnEvent"):
        decode_as(encode(make_events()[0]), TurnEvent)


def test_int_fields_refuse_floats() -> None:
    with pytest.raises(ValueError, match="integers"):
        TurnEvent(
            trajectory_id="u/0",
            uid="u",
            sample_index=0,
            attempt_id="a",
            turn_index=0,
            role="assistant",
            token_ids=[1.5],
            min_global_steps=0,
            max_global_steps=0,
        )


def test_every_event_reads_its_versions_the_same_way() -> None:
    from schemas.events import ExtraFields, ScoredTrajectory, TrainingGroup

    scored = ScoredTrajectory(
        uid="u",
        trajectory_id="u/0",
        sample_index=0,
        attempt_id="a",
        data_source="d",
        prompt_ids=[1],
        response_ids=[2],
        response_mask=[1],
        response_logprobs=[-0.5],
        num_turns=2,
        reward_score=1.0,
        extra_fields=ExtraFields(min_global_steps=3, max_global_steps=5),
    )
    group = TrainingGroup(
        uid="u",
        samples=[scored],
        advantages=[0.0],
        min_global_steps=3,
        max_global_steps=5,
        emitted_at_version=5,
    )
    for event in (scored, group):
        assert (event.min_global_steps, event.max_global_steps) == (3, 5)


def test_routed_experts_ride_a_trajectory_packed_and_within_its_positions() -> None:
    from schemas.routing import RoutedExperts

    good = orjson.loads(encode(make_events()[3]))
    assert "routed_experts" not in good  # a dense policy's: the bytes of before the field
    assert "routed_experts" not in orjson.loads(encode(make_events()[1]))  # a turn's too
    rows = np.arange(8 * 3 * 2).reshape(8, 3, 2) % 8  # 4 prompt + 5 response, last not fed
    routed = RoutedExperts.from_array(rows, num_experts=8)
    with_routing = {**good, "routed_experts": routed.model_dump(mode="json")}
    assert isinstance(with_routing["routed_experts"]["experts"], str)  # base64 of u1
    event = decode(orjson.dumps(with_routing))
    assert event.routed_experts == routed
    group = make_events()[4].model_copy(update={"samples": [event]})
    assert decode(encode(group)).samples[0].routed_experts == routed  # rides to rl.replay
    past = RoutedExperts.from_array(np.zeros((10, 3, 2), dtype=np.uint8), num_experts=8)
    with pytest.raises(DecodeError, match="past the 9 of prompt_ids"):
        decode(orjson.dumps({**good, "routed_experts": past.model_dump(mode="json")}))


def test_a_replicas_role_is_on_the_wire_only_when_it_is_a_judge() -> None:
    from schemas.events import ReplicaInfo

    policy = ReplicaInfo(replica_id="p", address="http://h:1", backend="hf")
    judge = policy.model_copy(update={"replica_id": "j", "role": "judge"})
    # A policy replica's record is what readers that predate roles read (extra="forbid").
    assert "role" not in orjson.loads(encode(policy))
    assert decode(encode(policy)).role == "policy" and decode(encode(judge)).role == "judge"
    with pytest.raises(DecodeError):
        decode(orjson.dumps({**orjson.loads(encode(policy)), "role": "critic"}))


def test_a_policy_version_without_transfer_encodes_as_before_the_field() -> None:
    """`PolicyVersion.transfer` (broadcast weights) is left out of the JSON when unset, so a
    record of `weights.mode: disk` is byte for byte what older readers read."""
    from schemas.events import WeightTransfer

    plain = PolicyVersion(version=4, path="/ckpt/step-4", created_at=1.0)
    assert orjson.loads(encode(plain)) == {
        "schema_version": 1,
        "created_at": 1.0,
        "kind": "policy",
        "version": 4,
        "path": "/ckpt/step-4",
        "groups_trained": 0,
        "samples_trained": 0,
    }
    sent = PolicyVersion(version=5, transfer=WeightTransfer(address="10.0.0.1:29500", session="s"))
    back = decode(encode(sent))
    assert back == sent and back.path == "" and back.transfer.backend == "gloo"


@pytest.mark.parametrize("event", make_events(), ids=lambda e: type(e).__name__)
def test_bytes_and_other_buffers_decode_alike(event) -> None:
    # Whatever buffer the client hands over (aiokafka: bytes; tests and tools: str), the
    # same event.
    data = encode(event)
    assert decode(data) == decode(bytearray(data)) == decode(data.decode()) == event


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_literals_stay_invalid_json(literal) -> None:
    # orjson rejects them (pydantic-core's own JSON parser would accept them): a decoder
    # swapped for speed must keep rejecting them.
    good = encode(make_events()[1])
    value = good[:-1] + b',"tool_reward":' + literal + b"}"
    with pytest.raises(DecodeError) as info:
        decode(value)
    assert info.value.cause == "json"
