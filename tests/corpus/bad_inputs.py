"""The bad-input corpus: every case names its stage, its raw message and its expected outcome.

A case is injected into the input topic of one stage run:

    stage        input topic   run(s)
    agent-loop   prompts       "default"  (in-process worker, scripted replica, test tools)
    reward       turns         "rule"     gsm8k rule scorer, on_failure=dlq
                               "process"  custom function in the process pool, on_failure=dlq
                               "thread"   custom function in a thread, on_failure=score
    replay       scored        "default"
    trainer      replay        "default"  (the trainer's `TrajectoryConsumer`, name "trainer")

and must end in one of four ways (`Expect.outcome`):

    dlq            a dead letter on `rl.dlq` with `rl.dlq.stage` = the stage and
                   `rl.dlq.error.cause` = `cause`, whose message contains `contains`
    failure_score  a `ScoredTrajectory` on `rl.scored` with `reward_extra.reward_failed`
                   and `reward_error_cause` = `cause`
    in_band        a complete trajectory whose tool turn answers the model with `contains`
                   (tool-level faults are the model's problem, answered in the conversation)
    output         the message flows on like valid traffic (accepted by design)

Every case's message is keyed and identified so its outcome can be found again: the record
key is the case id (or, where the value has a uid, the uid is the case id and the key is what
the topic's contract says). `bug` marks a case whose expected outcome the code does not reach
yet, with the precise reason; the suite marks it `xfail(strict=True)`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from schemas.codec import encode, headers_for
from schemas.events import (
    EventBase,
    ExtraFields,
    PolicyVersion,
    PromptEvent,
    RewardModelSpec,
    ScoredTrajectory,
    TrainingGroup,
    TurnEvent,
)

__all__ = [
    "CASES",
    "Case",
    "Expect",
    "Message",
    "replica_script",
    "valid_messages",
]

Stage = Literal["agent-loop", "reward", "replay", "trainer"]
Outcome = Literal["dlq", "failure_score", "in_band", "output"]
Build = Callable[[Any], "Message"]  # tokenizer → message

_MIB = 1024 * 1024


@dataclass(frozen=True)
class Message:
    """One record as produced to the stage's input topic."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class Expect:
    outcome: Outcome
    cause: str | None = None
    contains: str = ""

    def describe(self) -> str:
        what = self.outcome if self.cause is None else f"{self.outcome}:{self.cause}"
        return f"{what} ~ {self.contains!r}" if self.contains else what


@dataclass(frozen=True)
class Case:
    id: str
    stage: Stage
    what: str
    build: Build
    expect: Expect
    run: str = "default"
    bug: str | None = None


# --- builders ------------------------------------------------------------------------


def _event(event: EventBase, key: str | bytes | None = None) -> Message:
    if key is None:
        key = getattr(event, "trajectory_id", None) if isinstance(event, TurnEvent) else None
        key = key or getattr(event, "uid", None) or "policy"
    raw_key = key.encode() if isinstance(key, str) else key
    return Message(raw_key, encode(event), headers_for(event))


def _raw(key: str, value: bytes | None) -> Message:
    return Message(key.encode(), value)


def _mutated(event: EventBase, key: str, change: Callable[[dict[str, Any]], None]) -> Message:
    """The event's JSON with `change` applied to it (to break one field on purpose)."""
    data = event.model_dump(mode="json")
    change(data)
    return Message(key.encode(), orjson.dumps(data), headers_for(event))


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda data: data.update(values)


def _drop(*names: str) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        for name in names:
            data.pop(name, None)

    return change


def prompt(uid: str, text: str = "What is 2 + 3?", **kw: Any) -> PromptEvent:
    return PromptEvent(
        uid=uid,
        prompt=[{"role": "user", "content": text}],
        data_source="openai/gsm8k",
        reward_model={"ground_truth": "5"},
        **kw,
    )


def tool_prompt(uid: str, tools: list[str]) -> PromptEvent:
    """A tool-agent prompt whose marker tells the scripted replica which call to make."""
    return prompt(
        uid,
        f"[corpus:{uid}] Use a tool.",
        agent_name="tool_agent",
        extra_info={"tool_selection": tools},
    )


def turn(
    tok: Any,
    uid: str,
    *,
    truth: str | None = "5",
    data_source: str = "openai/gsm8k",
    text: str = "so #### 5",
) -> TurnEvent:
    """A one-turn trajectory (turn 0 is final), as the agent-loop worker writes it."""
    ids = tok.encode(text)
    return TurnEvent(
        trajectory_id=f"{uid}/0",
        uid=uid,
        sample_index=0,
        attempt_id="a",
        turn_index=0,
        role="assistant",
        token_ids=ids,
        logprobs=[-0.5] * len(ids),
        min_global_steps=0,
        max_global_steps=0,
        stop_reason="stop",
        final=True,
        prompt_ids=tok.encode("What is 2 + 3?"),
        data_source=data_source,
        reward_model=RewardModelSpec(ground_truth=truth),
        group_size=1,
        num_turns=2,
        response_length=len(ids),
        extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
    )


def scored(uid: str, index: int, reward: float) -> ScoredTrajectory:
    return ScoredTrajectory(
        uid=uid,
        trajectory_id=f"{uid}/{index}",
        sample_index=index,
        attempt_id="a",
        data_source="openai/gsm8k",
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        response_mask=[1, 1],
        response_logprobs=[-0.1, -0.2],
        num_turns=2,
        reward_score=reward,
        group_size=2,
        extra_fields={"min_global_steps": 0, "max_global_steps": 0},
    )


def group(uid: str) -> TrainingGroup:
    return TrainingGroup(
        uid=uid,
        samples=[scored(uid, 0, 1.0), scored(uid, 1, 0.0)],
        advantages=[1.0, -1.0],
        min_global_steps=0,
        max_global_steps=0,
        emitted_at_version=0,
    )


def valid_messages(stage: Stage, run: str, tok: Any) -> dict[str, list[Message]]:
    """Valid traffic interleaved with the cases: id → the messages that make one output.

    The id is the uid of the prompt / trajectory / group that must come out the other end.
    """
    if stage == "agent-loop":
        out = {
            f"valid-al-{i}": [_event(prompt(f"valid-al-{i}", f"What is {i} + 5?"))]
            for i in range(3)
        }
        out["valid-al-tool"] = [_event(tool_prompt("valid-al-tool", ["calculator"]))]
        return out
    if stage == "reward":
        return {f"valid-rw-{run}-{i}": [_event(turn(tok, f"valid-rw-{run}-{i}"))] for i in range(3)}
    if stage == "replay":
        return {
            f"valid-rp-{i}": [_event(scored(f"valid-rp-{i}", j, float(j == 0))) for j in range(2)]
            for i in range(2)
        }
    return {f"valid-tr-{i}": [_event(group(f"valid-tr-{i}"))] for i in range(3)}


# --- the scripted replica's answers for the tool cases --------------------------------

_CALLS: dict[str, str] = {
    "valid-al-tool": '{"name": "calculator", "arguments": {"expression": "2 + 3"}}',
    "tool-bad-json": '{"name": "calculator", "arguments": {"expression": ',
    "tool-unknown": '{"name": "teleport", "arguments": {"to": "Mars"}}',
    "tool-bad-args": '{"name": "corpus_raises", "arguments": {"x": "not a number"}}',
    "tool-raises": '{"name": "corpus_raises", "arguments": {"x": 7}}',
    "tool-floods": '{"name": "corpus_floods", "arguments": {"megabytes": 5}}',
    "tool-hangs-sandbox": json.dumps(
        {"name": "code_interpreter", "arguments": {"code": "while True:\n    pass"}}
    ),
    "tool-prints-megabytes": json.dumps(
        {"name": "code_interpreter", "arguments": {"code": "print('B' * 5_000_000)"}}
    ),
    "tool-sleeps": '{"name": "corpus_sleeps", "arguments": {"seconds": 3}}',
    "tool-bug": '{"name": "corpus_broken", "arguments": {}}',
    "tool-infra": '{"name": "corpus_infra", "arguments": {}}',
}
_MARKER = re.compile(r"\[corpus:([\w-]+)\]")


def replica_script(prompt_text: str) -> str:
    """What the scripted replica answers: the case's tool call, then a final answer."""
    if "<tool_response>" in prompt_text:
        return "Done.\n#### 5<|im_end|>"
    match = _MARKER.search(prompt_text)
    if match and match.group(1) in _CALLS:
        return f"<tool_call>\n{_CALLS[match.group(1)]}\n</tool_call>"
    return "The answer is 5.\n#### 5<|im_end|>"


# --- the cases -----------------------------------------------------------------------


def _al(id: str, what: str, build: Build, expect: Expect, bug: str | None = None) -> Case:
    return Case(id, "agent-loop", what, build, expect, bug=bug)


def _dlq(cause: str, contains: str = "") -> Expect:
    return Expect("dlq", cause, contains)


def _agent_loop_cases() -> list[Case]:
    p = prompt
    cases = [
        _al("al-json-malformed", "malformed JSON",
            lambda t: _raw("al-json-malformed", b'{"uid": "al-json-malformed", "prompt": ['),
            _dlq("json", "not valid JSON")),
        _al("al-json-truncated", "a valid prompt cut short",
            lambda t: _raw("al-json-truncated", encode(p("al-json-truncated"))[:-9]),
            _dlq("json", "not valid JSON")),
        _al("al-non-utf8", "binary, not UTF-8",
            lambda t: _raw("al-non-utf8", b"\xff\xfe\xfa\x00binary\x80"),
            _dlq("json", "UTF-8")),
        _al("al-non-utf8-in-string", "a latin-1 byte inside a JSON string",
            lambda t: _raw("al-non-utf8-in-string",
                           encode(p("al-non-utf8-in-string", "Caf\u00e9?")).replace(
                               "Caf\u00e9".encode(), b"Caf\xe9")),
            _dlq("json", "UTF-8")),
        _al("al-empty-value", "zero-byte value", lambda t: _raw("al-empty-value", b""),
            _dlq("json")),
        _al("al-tombstone", "null value (tombstone)", lambda t: _raw("al-tombstone", None),
            _dlq("empty", "tombstone")),
        _al("al-not-object", "a JSON array", lambda t: _raw("al-not-object", b'["a", "b"]'),
            _dlq("shape", "expected a JSON object")),
        _al("al-schema-v2", "schema_version 2",
            lambda t: _mutated(p("al-schema-v2"), "al-schema-v2", _set(schema_version=2)),
            _dlq("schema_version", "unsupported schema_version 2")),
        _al("al-schema-missing", "no schema_version",
            lambda t: _mutated(p("al-schema-missing"), "al-schema-missing",
                               _drop("schema_version")),
            _dlq("schema_version", "None")),
        _al("al-schema-string", 'schema_version "1" (a string)',
            lambda t: _mutated(p("al-schema-string"), "al-schema-string",
                               _set(schema_version="1")),
            _dlq("schema_version", "'1'")),
        _al("al-kind-unknown", "kind 'prompt_v9'",
            lambda t: _mutated(p("al-kind-unknown"), "al-kind-unknown", _set(kind="prompt_v9")),
            _dlq("validation", "prompt_v9")),
        _al("al-wrong-kind", "a PolicyVersion on the prompts topic",
            lambda t: _event(PolicyVersion(version=3, path="/ckpt/3"), "al-wrong-kind"),
            _dlq("wrong_kind", "expected PromptEvent, got PolicyVersion")),
        _al("al-missing-uid", "no uid",
            lambda t: _mutated(p("al-missing-uid"), "al-missing-uid", _drop("uid")),
            _dlq("validation", "uid: Field required")),
        _al("al-missing-data-source", "no data_source",
            lambda t: _mutated(p("al-missing-data-source"), "al-missing-data-source",
                               _drop("data_source")),
            _dlq("validation", "data_source: Field required")),
        _al("al-wrong-type-n", 'n = "four"',
            lambda t: _mutated(p("al-wrong-type-n"), "al-wrong-type-n", _set(n="four")),
            _dlq("validation", "prompt.n")),
        _al("al-wrong-type-prompt", "prompt is a string, not messages",
            lambda t: _mutated(p("al-wrong-type-prompt"), "al-wrong-type-prompt",
                               _set(prompt="What is 2 + 3?")),
            _dlq("validation", "prompt.prompt")),
        _al("al-bad-role", "message role 'robot'",
            lambda t: _mutated(p("al-bad-role"), "al-bad-role",
                               _set(prompt=[{"role": "robot", "content": "beep"}])),
            _dlq("validation", "role")),
        _al("al-extra-field", "an unknown field",
            lambda t: _mutated(p("al-extra-field"), "al-extra-field", _set(priority=1)),
            _dlq("validation", "Extra inputs are not permitted")),
        _al("al-empty-prompt", "empty prompt (no messages)",
            lambda t: _mutated(p("al-empty-prompt"), "al-empty-prompt", _set(prompt=[])),
            _dlq("validation", "at least 1 item")),
        _al("al-empty-uid", 'uid ""',
            lambda t: _mutated(p("al-empty-uid"), "al-empty-uid", _set(uid="")),
            _dlq("validation", "uid")),
        _al("al-n-zero", "n = 0",
            lambda t: _mutated(p("al-n-zero"), "al-n-zero", _set(n=0)),
            _dlq("validation", "greater than or equal to 1")),
        _al("al-empty-content", "a user message with empty content (valid by the schema)",
            lambda t: _event(p("al-empty-content", "")), Expect("output")),
        _al("al-too-long", "prompt longer than max_prompt_length",
            lambda t: _event(p("al-too-long", "word " * 3000)),
            _dlq("prompt_too_long", "over max_prompt_length")),
        # 1 MiB, not 10: tokenizing 10 MiB blocks the worker's event loop for ~20 s on a busy
        # CPU (heartbeats expire, the group rebalances, replica calls time out).
        _al("al-huge-1mb", "a 1 MiB prompt, 500x the context",
            lambda t: _event(p("al-huge-1mb", "lorem " * (_MIB // 6))),
            _dlq("prompt_too_long", "over max_prompt_length")),
        _al("al-unknown-agent", "agent_name 'no_such_agent'",
            lambda t: _event(p("al-unknown-agent", agent_name="no_such_agent")),
            _dlq("unknown_agent", "no_such_agent")),
        _al("al-tool-selection-type", "tool_selection is a string",
            lambda t: _event(p("al-tool-selection-type", agent_name="tool_agent",
                               extra_info={"tool_selection": "calculator"})),
            _dlq("tool_config", "must be a list")),
        _al("al-tool-selection-unknown", "tool_selection names a tool nobody offers",
            lambda t: _event(tool_prompt("al-tool-selection-unknown", ["calculator", "teleport"])),
            _dlq("tool_config", "teleport")),
        _al("al-key-mismatch", "record key is not the prompt's uid",
            lambda t: _event(p("al-key-mismatch"), "wrong-key-al"),
            _dlq("key_mismatch")),
    ]  # fmt: skip
    tool = [
        ("tool-bad-json", "a tool call with invalid JSON", ["calculator"],
         Expect("in_band", contains="Error:")),
        ("tool-unknown", "a call to a tool that does not exist", ["corpus_raises"],
         Expect("in_band", contains="Error: unknown tool 'teleport'")),
        ("tool-bad-args", "arguments of the wrong type", ["corpus_raises"],
         Expect("in_band", contains="Error: invalid arguments for tool 'corpus_raises'")),
        ("tool-raises", "a function tool that raises", ["corpus_raises"],
         Expect("in_band", contains="Error: ValueError: corpus tool exploded")),
        ("tool-floods", "a tool that returns 5 MiB", ["corpus_floods"],
         Expect("in_band", contains="...(truncated)...")),
        ("tool-hangs-sandbox", "code that never ends (interpreter wall limit)",
         ["code_interpreter"], Expect("in_band", contains="[killed: wall-time limit")),
        ("tool-prints-megabytes", "code that prints 5 MB (interpreter output cap)",
         ["code_interpreter"], Expect("in_band", contains="[output truncated at")),
        ("tool-sleeps", "a function tool that hangs (3 s, past any sane call timeout)",
         ["corpus_sleeps"], Expect("in_band", contains="timed out")),
        ("tool-infra", "a tool whose sandbox cannot start (SandboxError)", ["corpus_infra"],
         _dlq("sandbox", "namespaces")),
        ("tool-bug", "a BaseTool raising RuntimeError (a bug in the tool)", ["corpus_broken"],
         _dlq("agent_loop", "RuntimeError")),
    ]  # fmt: skip
    bugs: dict[str, str] = {}
    for id, what, tools, expect in tool:
        cases.append(
            _al(
                id,
                what,
                lambda t, i=id, s=tools: _event(tool_prompt(i, s)),
                expect,
                bug=bugs.get(id),
            )
        )
    return cases


def _rw(id: str, run: str, what: str, build: Build, expect: Expect, bug: str | None = None) -> Case:
    return Case(id, "reward", what, build, expect, run=run, bug=bug)


def _reward_cases() -> list[Case]:
    def t(tok: Any, uid: str, **kw: Any) -> TurnEvent:
        return turn(tok, uid, **kw)

    def both_nulls(data: dict[str, Any]) -> None:
        data.update(prompt_ids=None, data_source=None)

    return [
        _rw("rw-json-malformed", "rule", "malformed JSON",
            lambda k: _raw("rw-json-malformed", b'{"kind": "turn", "token_ids": '),
            _dlq("json", "not valid JSON")),
        _rw("rw-non-utf8", "rule", "binary, not UTF-8",
            lambda k: _raw("rw-non-utf8", b"\x00\xc3\x28\xff turn"), _dlq("json", "UTF-8")),
        _rw("rw-tombstone", "rule", "null value (tombstone)",
            lambda k: _raw("rw-tombstone", None), _dlq("empty", "tombstone")),
        _rw("rw-huge-junk", "rule", "10 MiB of junk bytes (accepted by the broker)",
            lambda k: _raw("rw-huge-junk", b"\x00junk" * (10 * _MIB // 5)),
            _dlq("json", "not valid JSON")),
        _rw("rw-schema-v2", "rule", "schema_version 2",
            lambda k: _mutated(t(k, "rw-schema-v2"), "rw-schema-v2/0", _set(schema_version=2)),
            _dlq("schema_version", "unsupported schema_version 2")),
        _rw("rw-wrong-kind", "rule", "a PromptEvent on the turns topic",
            lambda k: _event(prompt("rw-wrong-kind")),
            _dlq("wrong_kind", "expected TurnEvent, got PromptEvent")),
        _rw("rw-missing-attempt", "rule", "no attempt_id",
            lambda k: _mutated(t(k, "rw-missing-attempt"), "rw-missing-attempt/0",
                               _drop("attempt_id")),
            _dlq("validation", "attempt_id: Field required")),
        _rw("rw-bad-token-ids", "rule", "token_ids not base64",
            lambda k: _mutated(t(k, "rw-bad-token-ids"), "rw-bad-token-ids/0",
                               _set(token_ids="%%% not base64 %%%")),
            _dlq("validation", "token_ids")),
        _rw("rw-token-ids-type", "rule", "token_ids a list of strings",
            lambda k: _mutated(t(k, "rw-token-ids-type"), "rw-token-ids-type/0",
                               _set(token_ids=["a", "b"])),
            _dlq("validation", "token_ids")),
        _rw("rw-traj-id-mismatch", "rule", "trajectory_id is not uid/sample_index",
            lambda k: _mutated(t(k, "rw-traj-id-mismatch"), "rw-traj-id-mismatch/0",
                               _set(trajectory_id="someone-else/0")),
            _dlq("validation", "trajectory_id must be")),
        _rw("rw-logprobs-length", "rule", "fewer logprobs than tokens",
            lambda k: _mutated(t(k, "rw-logprobs-length"), "rw-logprobs-length/0",
                               _set(logprobs=[-0.5])),
            _dlq("validation", "differ in length")),
        _rw("rw-final-no-totals", "rule", "final turn without num_turns/extra_fields",
            lambda k: _mutated(t(k, "rw-final-no-totals"), "rw-final-no-totals/0",
                               _set(num_turns=None, extra_fields=None)),
            _dlq("validation", "final turn must carry")),
        _rw("rw-incomplete-turn0", "rule", "turn 0 without prompt_ids and data_source",
            lambda k: _mutated(t(k, "rw-incomplete-turn0"), "rw-incomplete-turn0/0", both_nulls),
            _dlq("incomplete_turn0", "no prompt_ids")),
        _rw("rw-key-mismatch", "rule", "record key is not the trajectory id",
            lambda k: _event(t(k, "rw-key-mismatch"), "wrong-key-rw/0"),
            _dlq("key_mismatch")),
        _rw("rw-unknown-data-source", "rule", "data_source nobody scores",
            lambda k: _event(t(k, "rw-unknown-data-source", data_source="no/such-set")),
            _dlq("unknown_data_source", "no/such-set")),
        _rw("rw-no-ground-truth", "rule", "gsm8k without a ground truth",
            lambda k: _event(t(k, "rw-no-ground-truth", truth=None)),
            _dlq("scorer_error", "ground_truth")),
        _rw("rw-custom-raises", "process", "custom reward raises (process pool)",
            lambda k: _event(t(k, "rw-custom-raises", truth="RAISE")),
            _dlq("scorer_error", "corpus reward exploded")),
        _rw("rw-custom-hangs", "process", "custom reward hangs (process pool, killed)",
            lambda k: _event(t(k, "rw-custom-hangs", truth="HANG")),
            _dlq("scorer_timeout", "exceeded")),
        _rw("rw-custom-crashes", "process", "custom reward kills its process",
            lambda k: _event(t(k, "rw-custom-crashes", truth="CRASH")),
            _dlq("scorer_crashed")),
        _rw("rw-custom-not-a-number", "process", "custom reward returns a string",
            lambda k: _event(t(k, "rw-custom-not-a-number", truth="NOT_A_NUMBER")),
            _dlq("scorer_error", "got str")),
        _rw("rw-custom-nan-process", "process", "custom reward returns NaN (process pool)",
            lambda k: _event(t(k, "rw-custom-nan-process", truth="NAN")),
            _dlq("scorer_error")),
        _rw("rw-score-raises", "thread", "custom reward raises, on_failure=score",
            lambda k: _event(t(k, "rw-score-raises", truth="RAISE")),
            Expect("failure_score", "scorer_error", "corpus reward exploded")),
        _rw("rw-score-hangs", "thread", "custom reward hangs (thread), on_failure=score",
            lambda k: _event(t(k, "rw-score-hangs", truth="HANG")),
            Expect("failure_score", "scorer_timeout", "exceeded")),
        _rw("rw-score-nan", "thread", "custom reward returns NaN (thread), on_failure=score",
            lambda k: _event(t(k, "rw-score-nan", truth="NAN")),
            Expect("failure_score", "scorer_error")),
    ]  # fmt: skip


def _rp(id: str, what: str, build: Build, expect: Expect) -> Case:
    return Case(id, "replay", what, build, expect)


def _replay_cases() -> list[Case]:
    s = scored

    def inverted(data: dict[str, Any]) -> None:
        data["extra_fields"] = {"min_global_steps": 5, "max_global_steps": 1}

    return [
        _rp("rp-json-malformed", "malformed JSON",
            lambda k: _raw("rp-json-malformed", b'{"kind": "scored", '), _dlq("json")),
        _rp("rp-non-utf8", "binary, not UTF-8",
            lambda k: _raw("rp-non-utf8", b"\xfe\xed\xfa\xce"), _dlq("json", "UTF-8")),
        _rp("rp-tombstone", "null value (tombstone)",
            lambda k: _raw("rp-tombstone", None), _dlq("empty", "tombstone")),
        _rp("rp-schema-v2", "schema_version 2",
            lambda k: _mutated(s("rp-schema-v2", 0, 1.0), "rp-schema-v2", _set(schema_version=2)),
            _dlq("schema_version")),
        _rp("rp-wrong-kind", "a TurnEvent on the scored topic",
            lambda k: _event(turn(k, "rp-wrong-kind"), "rp-wrong-kind"),
            _dlq("wrong_kind", "expected ScoredTrajectory, got TurnEvent")),
        _rp("rp-key-mismatch", "record key is not the uid",
            lambda k: _event(s("rp-key-mismatch", 0, 1.0), "wrong-key-rp"),
            _dlq("key_mismatch", "is not the sample's uid")),
        _rp("rp-missing-mask", "no response_mask",
            lambda k: _mutated(s("rp-missing-mask", 0, 1.0), "rp-missing-mask",
                               _drop("response_mask")),
            _dlq("validation", "response_mask: Field required")),
        _rp("rp-array-lengths", "response arrays of different lengths",
            lambda k: _mutated(s("rp-array-lengths", 0, 1.0), "rp-array-lengths",
                               _set(response_logprobs=[-0.1])),
            _dlq("validation", "differ in length")),
        _rp("rp-null-reward", "reward_score null (what a NaN becomes in JSON)",
            lambda k: _mutated(s("rp-null-reward", 0, 1.0), "rp-null-reward",
                               _set(reward_score=None)),
            _dlq("validation", "reward_score")),
        _rp("rp-reward-type", 'reward_score "high"',
            lambda k: _mutated(s("rp-reward-type", 0, 1.0), "rp-reward-type",
                               _set(reward_score="high")),
            _dlq("validation", "reward_score")),
        _rp("rp-versions-inverted", "min_global_steps > max_global_steps",
            lambda k: _mutated(s("rp-versions-inverted", 0, 1.0), "rp-versions-inverted",
                               inverted),
            _dlq("validation", "must not exceed")),
    ]  # fmt: skip


def _tr(id: str, what: str, build: Build, expect: Expect, bug: str | None = None) -> Case:
    return Case(id, "trainer", what, build, expect, bug=bug)


def _trainer_cases() -> list[Case]:
    g = group

    def foreign_sample(data: dict[str, Any]) -> None:
        data["samples"][1] = scored("someone-else", 1, 0.0).model_dump(mode="json")

    return [
        _tr("tr-json-malformed", "malformed JSON",
            lambda k: _raw("tr-json-malformed", b'{"kind": "group", "samples": [}'), _dlq("json")),
        _tr("tr-non-utf8", "binary, not UTF-8",
            lambda k: _raw("tr-non-utf8", b"\x89PNG\r\n\x1a\n\x00"), _dlq("json", "UTF-8")),
        _tr("tr-tombstone", "null value (tombstone)",
            lambda k: _raw("tr-tombstone", None), _dlq("empty", "tombstone")),
        _tr("tr-schema-v2", "schema_version 2",
            lambda k: _mutated(g("tr-schema-v2"), "tr-schema-v2", _set(schema_version=2)),
            _dlq("schema_version")),
        _tr("tr-wrong-kind", "a ScoredTrajectory on the replay topic",
            lambda k: _event(scored("tr-wrong-kind", 0, 1.0)),
            _dlq("wrong_kind", "does not belong")),
        _tr("tr-advantages", "one advantage for two samples",
            lambda k: _mutated(g("tr-advantages"), "tr-advantages", _set(advantages=[1.0])),
            _dlq("validation", "one advantage per sample")),
        _tr("tr-foreign-sample", "a sample of another uid inside the group",
            lambda k: _mutated(g("tr-foreign-sample"), "tr-foreign-sample", foreign_sample),
            _dlq("validation", "must belong to the group's uid")),
        _tr("tr-key-mismatch", "record key is not the group's uid",
            lambda k: _event(g("tr-key-mismatch"), "wrong-key-tr"),
            _dlq("key_mismatch")),
    ]  # fmt: skip


CASES: list[Case] = [
    *_agent_loop_cases(),
    *_reward_cases(),
    *_replay_cases(),
    *_trainer_cases(),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
