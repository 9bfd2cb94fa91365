"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

from __future__ import annotations

import pytest

from workers.agent_loop.parsers import FunctionCall, HermesToolParser

hermes = HermesToolParser()


def test_no_call() -> None:
    assert hermes.parse("The answer is 4.") == ("The answer is 4.", [])
    assert hermes.parse("") == ("", [])
    # A mention of the tag without a complete call is content.
    text = "I could use <tool_call> here but won't"
    assert hermes.parse(text) == (text, [])


def test_one_call_with_text_around() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n'
        "</tool_call>\nDone"
    )
    content, calls = hermes.parse(text)
    assert calls == [FunctionCall("calculator", {"expression": "6 * 7"})]
    assert content == "Let me compute.\n\nDone"


def test_several_calls_keep_order() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"arguments": {"y": [1, 2]}, "name": "b"}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    content, calls = hermes.parse(text)
    assert content == ""
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("a", {"x": 1}, None),
        ("b", {"y": [1, 2]}, None),
        ("c", {}, None),
    ]


def test_parameters_instead_of_arguments_are_read() -> None:
    _, calls = hermes.parse('<tool_call>{"name": "f", "parameters": {"q": "x"}}</tool_call>')
    assert calls == [FunctionCall("f", {"q": "x"})]
    # With both, `arguments` is the one the format names.
    _, calls = hermes.parse(
        '<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>'
    )
    assert calls == [FunctionCall("f", {"a": 1})]


def test_invalid_json_is_an_error_call() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    _, calls = hermes.parse(text)
    assert len(calls) == 2
    assert calls[0].error is not None and "not valid JSON" in calls[0].error
    assert calls[0].arguments == '{"name": "a", "arguments": {"x": 1}'  # the raw text
    assert calls[1] == FunctionCall("b", {})


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('{"arguments": {"x": 1}}', "has no 'name'"),
        ('{"name": "", "arguments": {}}', "has no 'name'"),
        ('{"name": 3}', "has no 'name'"),
        ('["calculator", {}]', "must be a JSON object"),
        ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "f", "parameters": "x"}', "arguments of 'f' are not valid JSON"),
        ('{"name": "f", "arguments": "{bad"}', "arguments of 'f' are not valid JSON"),
        ("", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_malformed_calls(block: str, message: str) -> None:
    _, calls = hermes.parse(f"<tool_call>{block}</tool_call>")
    assert len(calls) == 1
    assert calls[0].error is not None and message in calls[0].error


def test_double_encoded_arguments() -> None:
    _, calls = hermes.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert calls == [FunctionCall("f", {"x": 2})]
    _, calls = hermes.parse('<tool_call>{"name": " f ", "arguments": null}</tool_call>')
    assert calls == [FunctionCall("f", {})]


def test_unclosed_last_block() -> None:
    # Stopped on the stop string with the closing tag cut off: still a call.
    content, calls = hermes.parse('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert content == "Sure." and calls == [FunctionCall("f", {"a": 1})]
    # Cut off mid-JSON: content, not a call.
    text = (
        '<tool_call>{"name": "g", "arguments": {}}</tool_call> and <tool_call>{"name": "f", "argu'
    )
    content, calls = hermes.parse(text)
    assert calls == [FunctionCall("g", {})]
    assert content == 'and <tool_call>{"name": "f", "argu'
