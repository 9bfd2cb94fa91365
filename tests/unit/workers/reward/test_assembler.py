"""Trajectory assembly: attempts, order, duplicates, the state's bytes, the built arrays."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.codec import decode, encode
from schemas.errors import DecodeError
from schemas.events import ExtraFields, RewardModelSpec, ScoredTrajectory, TurnEvent
from schemas.routing import RoutedExperts
from workers.reward.assembler import TrajectoryState, apply_turn, assemble


def turn(
    index: int, *, attempt: str = "a", last: int = 2, role: str | None = None, **kw: object
) -> TurnEvent:
    role = role or ("assistant" if index % 2 == 0 else "tool")
    final = index == last
    tokens = [10 * index + j for j in range(3)]
    fields: dict[str, object] = {
        "trajectory_id": "u/0",
        "uid": "u",
        "sample_index": 0,
        "attempt_id": attempt,
        "turn_index": index,
        "role": role,
        "token_ids": tokens,
        "logprobs": [-0.1 * (index + 1)] * 3 if role == "assistant" else None,
        "min_global_steps": 3 + index,
        "max_global_steps": 4 + index,
        "final": final,
    }
    if index == 0:
        fields.update(
            prompt_ids=[1, 2],
            data_source="openai/gsm8k",
            reward_model=RewardModelSpec(ground_truth="7"),
            extra_info={"k": 1},
        )
    if final:
        fields.update(
            num_turns=last + 2, extra_fields=ExtraFields(min_global_steps=3, max_global_steps=4)
        )
    fields.update(kw)
    return TurnEvent(**fields)  # type: ignore[arg-type]


def feed(state: TrajectoryState | None, *turns: TurnEvent) -> tuple[TrajectoryState, list[str]]:
    outcomes = []
    for t in turns:
        state, outcome = apply_turn(state, t, encode(t))
        outcomes.append(outcome)
    assert state is not None
    return state, outcomes


def test_in_order_completes_on_the_final_turn() -> None:
    state, outcomes = feed(None, turn(0), turn(1), turn(2))
    assert outcomes == ["added", "added", "complete"]
    assert state.complete


def test_a_missing_middle_turn_that_arrives_late() -> None:
    state, outcomes = feed(None, turn(0), turn(2), turn(1))
    assert outcomes == ["added", "added", "complete"]
    built = assemble(state)
    assert built.fields["response_ids"].tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22]


def test_newer_attempt_replaces_an_unfinished_one_and_old_turns_are_stale() -> None:
    state, outcomes = feed(None, turn(0, attempt="a"), turn(1, attempt="a"), turn(0, attempt="b"))
    assert outcomes[-1] == "replaced_attempt"
    assert state.attempt_id == "b" and state.superseded == ["a"]
    state, outcomes = feed(state, turn(2, attempt="a"), turn(1, attempt="b"), turn(2, attempt="b"))
    assert outcomes == ["stale_attempt", "added", "complete"]
    assert assemble(state).fields["attempt_id"] == "b"


def test_first_completed_attempt_wins_and_later_completions_are_counted() -> None:
    state, _ = feed(None, turn(0), turn(1), turn(2))
    state, outcomes = feed(state, turn(0, attempt="b"), turn(1, attempt="b"), turn(2, attempt="b"))
    assert outcomes == ["after_done", "after_done", "duplicate_completion"]
    assert state.attempt_id == "a"
    state.mark_done("scored")
    state, outcomes = feed(state, turn(2))
    assert outcomes == ["duplicate_completion"]
    assert state.turns == {}


def test_duplicate_turn_keeps_the_first() -> None:
    _, outcomes = feed(None, turn(0), turn(1), turn(1, token_ids=[9]))
    assert outcomes == ["added", "added", "duplicate_turn"]


def test_unknown_attempt_non_initial_turn_is_stale() -> None:
    _, outcomes = feed(None, turn(0, attempt="a"), turn(1, attempt="z"))
    assert outcomes == ["added", "stale_attempt"]


def test_single_turn_trajectory() -> None:
    state, outcomes = feed(None, turn(0, last=0))
    assert outcomes == ["complete"]
    assert assemble(state).fields["num_turns"] == 2


def test_state_bytes_round_trip() -> None:
    state, _ = feed(None, turn(0), turn(2))
    state.superseded = ["old"]
    state.updated_at = 1_799_999_000.25
    again = TrajectoryState.from_bytes(state.to_bytes())
    assert again == state and again.updated_at == 1_799_999_000.25
    state.mark_done("scored", at=1_800_000_000.5)
    again = TrajectoryState.from_bytes(state.to_bytes())
    assert again == state and again.done_at == 1_800_000_000.5 and again.turns == {}
    with pytest.raises(ValueError):
        TrajectoryState.from_bytes(b"junk")


def test_assemble_builds_what_the_trainer_needs() -> None:
    state, _ = feed(
        None,
        turn(0),
        turn(1, tool_reward=0.5, metrics={"turn_score": 0.25}),
        turn(2, min_global_steps=1, max_global_steps=9),
    )
    built = assemble(state)
    f = built.fields
    assert f["prompt_ids"].tolist() == [1, 2]
    assert f["response_mask"].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert np.allclose(f["response_logprobs"], [-0.1] * 3 + [0.0] * 3 + [-0.3] * 3)
    assert f["tool_rewards"] == [0.5]
    assert f["turn_scores"] == [0.25]
    assert f["num_turns"] == 4
    assert (f["extra_fields"].min_global_steps, f["extra_fields"].max_global_steps) == (1, 9)
    assert built.ground_truth == "7" and built.data_source == "openai/gsm8k"
    assert built.extra_info == {"k": 1}


def test_assemble_rejects_a_turn0_without_prompt() -> None:
    bad0 = turn(0, last=0, prompt_ids=None)
    state, _ = feed(None, bad0)
    with pytest.raises(DecodeError):
        assemble(state)


def test_an_emitting_state_of_an_older_stage_is_read_as_assembling() -> None:
    """Stages before the commit-metadata recovery point wrote EMITTING markers holding the
    turns persisted before their batch; the rest are redelivered and complete it again."""
    state, _ = feed(None, turn(0), turn(1))
    state.status = "emitting"  # type: ignore[assignment]
    old = TrajectoryState.from_bytes(state.to_bytes())
    assert old.status == "assembling" and set(old.turns) == {0, 1}
    _, outcomes = feed(old, turn(0), turn(1), turn(2))
    assert outcomes == ["duplicate_turn", "duplicate_turn", "complete"]


# --- another prompt under the same uid --------------------------------------------------


def test_turn_0_of_another_prompt_is_a_duplicate_uid_while_assembling_and_when_done() -> None:
    state, outcomes = feed(None, turn(0, prompt_digest="aaaa"), turn(1, prompt_digest=None))
    assert outcomes == ["added", "added"]
    other = turn(0, attempt="b", prompt_digest="bbbb")
    state, outcome = apply_turn(state, other, encode(other))
    assert outcome == "duplicate_uid" and state.attempt_id == "a"  # nothing changed
    state, outcomes = feed(state, turn(2))
    assert outcomes == ["complete"]
    state.mark_done("scored", 1.0)
    done = TrajectoryState.from_bytes(state.to_bytes())
    assert done.digest == "aaaa"  # DONE keeps it, so a late other prompt is still recognised
    assert apply_turn(done, other, encode(other))[1] == "duplicate_uid"
    same = turn(0, attempt="c", prompt_digest="aaaa")
    assert apply_turn(done, same, encode(same))[1] == "after_done"  # a re-delivery, as before


def test_the_same_prompt_restarted_replaces_the_attempt_and_keeps_the_digest() -> None:
    state, _ = feed(None, turn(0, prompt_digest="aaaa"))
    state, outcomes = feed(state, turn(0, attempt="b", prompt_digest="aaaa"))
    assert outcomes == ["replaced_attempt"] and state.digest == "aaaa"


def test_the_digest_is_learnt_from_turn_0_when_a_later_turn_came_first() -> None:
    state, _ = feed(None, turn(1), turn(0, prompt_digest="aaaa"))
    assert state.digest == "aaaa"
    other = turn(0, attempt="b", prompt_digest="bbbb")
    assert apply_turn(state, other, encode(other))[1] == "duplicate_uid"


def test_prompt_digests_tell_prompts_apart_but_not_redeliveries() -> None:
    from schemas.events import ChatMessage, PromptEvent

    a = PromptEvent(
        uid="train-0", prompt=[ChatMessage(role="user", content="1+1?")], data_source="d"
    )
    again = PromptEvent.model_validate({**a.model_dump(), "created_at": 5.0})
    other = a.model_copy(update={"prompt": [ChatMessage(role="user", content="2+2?")]})
    assert a.content_digest() == again.content_digest() != other.content_digest()
    assert a.model_copy(update={"uid": "x"}).content_digest() == a.content_digest()


def routing(rows: list[int], layers: int = 2) -> RoutedExperts:
    r = np.asarray(rows)
    return RoutedExperts.from_array(np.stack([np.stack([r, r + 1], -1)] * layers, 1), 8)


def test_the_trajectorys_routing_is_its_turns_folded_append_only() -> None:
    # prompt 2 + turn 0 (3) + tool (3) + turn 2 (3) = 11 positions; each assistant turn's
    # routing starts at position 0 and covers what its generation fed (all but its last token).
    first = routing([0] * 4)
    later = routing([5] * 4 + [6] * 6)  # re-fed positions 0..3 under other weights: ignored
    state, _ = feed(None, turn(0, routed_experts=first), turn(1), turn(2, routed_experts=later))
    fields = assemble(state).fields
    assert fields["routed_experts"].as_array()[:, 0, 0].tolist() == [0] * 4 + [6] * 6
    scored = ScoredTrajectory(**fields, reward_score=1.0)
    assert decode(encode(scored)) == scored  # on the wire and back, packed u1
    plain, _ = feed(None, turn(0), turn(1), turn(2))
    assert assemble(plain).fields["routed_experts"] is None  # a dense policy's


def test_routing_that_does_not_fit_the_trajectory_is_a_decode_error() -> None:
    state, _ = feed(
        None,
        turn(0, routed_experts=routing([0] * 4)),
        turn(1),
        turn(2, routed_experts=routing([1] * 10, layers=3)),
    )
    with pytest.raises(DecodeError, match="turn 2: routing of a different model shape") as err:
        assemble(state)
    assert err.value.cause == "routing"
    state, _ = feed(None, turn(0, last=0, routed_experts=routing([0] * 6)))  # 5 positions
    with pytest.raises(DecodeError, match="cover 6 positions, past the trajectory's 5"):
        assemble(state)
