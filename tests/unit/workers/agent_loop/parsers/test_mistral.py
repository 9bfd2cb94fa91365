"""`mistral`: `[TOOL_CALLS]name[ARGS]{...}` (v11+) and `[TOOL_CALLS] [{...}]` (before v11)."""

from __future__ import annotations

import pytest

from workers.agent_loop.parsers import FunctionCall, MistralToolParser

mistral = MistralToolParser()


def test_no_call() -> None:
    assert mistral.parse("The answer is 4.</s>") == ("The answer is 4.</s>", [])


def test_one_call_v11() -> None:
    text = '[TOOL_CALLS]calculator[ARGS]{"expression": "2 + 3"}</s>'
    assert mistral.parse(text) == ("</s>", [FunctionCall("calculator", {"expression": "2 + 3"})])
    # The `[ARGS]` separator may be absent: the object follows the name.
    assert mistral.parse('[TOOL_CALLS]f{"a": 1}')[1] == [FunctionCall("f", {"a": 1})]
    # v13 carries the call id.
    _, calls = mistral.parse('[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"a": 1}')
    assert calls == [FunctionCall("f", {"a": 1}, None, "abc123XYZ")]


def test_two_calls_v11_keep_order() -> None:
    text = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{"y": [1, 2]}'
    assert mistral.parse(text) == (
        "",
        [FunctionCall("a", {"x": 1}), FunctionCall("b", {"y": [1, 2]})],
    )


def test_calls_before_v11_as_a_json_array() -> None:
    text = (
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}, "id": "abcdefghi"}, '
        '{"name": "b", "arguments": "{\\"y\\": 2}"}]</s>'
    )
    content, calls = mistral.parse(text)
    assert calls == [FunctionCall("a", {"x": 1}, None, "abcdefghi"), FunctionCall("b", {"y": 2})]
    assert content == "</s>"
    assert mistral.parse('[TOOL_CALLS] {"name": "a", "arguments": {}}')[1] == [
        FunctionCall("a", {})
    ]


def test_text_around_calls_is_content() -> None:
    text = 'Let me compute.[TOOL_CALLS]calculator[ARGS]{"expression": "6 * 7"} and more'
    content, calls = mistral.parse(text)
    assert calls == [FunctionCall("calculator", {"expression": "6 * 7"})]
    assert content == "Let me compute. and more"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[TOOL_CALLS]calculator[ARGS]{"expression": "2 +', "not valid JSON"),
        ("[TOOL_CALLS]calculator", "no name and arguments"),
        ('[TOOL_CALLS][ARGS]{"a": 1}', "no name and arguments"),
        ("[TOOL_CALLS]f[ARGS][1, 2]", "must be a JSON object"),
        ('[TOOL_CALLS] [{"name": "a", "arguments": {}', "not valid JSON"),
        ('[TOOL_CALLS] [{"arguments": {}}]', "has no 'name'"),
        ("[TOOL_CALLS] [3]", "must be a JSON object"),
    ],
)
def test_malformed_calls(text: str, message: str) -> None:
    _, calls = mistral.parse(text)
    assert len(calls) == 1 and calls[0].error is not None and message in calls[0].error
