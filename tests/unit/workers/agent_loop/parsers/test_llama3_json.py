"""`llama3_json`: `{"name": ..., "parameters": {...}}` calls, `;`-separated, maybe after
`<|python_tag|>`."""

from __future__ import annotations

import pytest

from workers.agent_loop.parsers import FunctionCall, Llama3JsonToolParser

llama = Llama3JsonToolParser()
CALC = '{"name": "calculator", "parameters": {"expression": "2 + 3"}}'


def test_one_call_as_the_whole_turn() -> None:
    assert llama.parse(CALC) == ("", [FunctionCall("calculator", {"expression": "2 + 3"})])
    # The end-of-turn token the model stopped on stays in the content, as other text does.
    assert llama.parse(f"{CALC}<|eot_id|>")[1] == [
        FunctionCall("calculator", {"expression": "2 + 3"})
    ]
    assert llama.parse(f"<|python_tag|>{CALC}") == (
        "",
        [FunctionCall("calculator", {"expression": "2 + 3"})],
    )


def test_two_calls_separated_by_semicolons_keep_order() -> None:
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": 2}}'
    assert llama.parse(text) == ("", [FunctionCall("a", {"x": 1}), FunctionCall("b", {"y": 2})])


def test_text_around_calls_is_content() -> None:
    content, calls = llama.parse(f"Let me compute. {CALC} Then I answer.")
    assert calls == [FunctionCall("calculator", {"expression": "2 + 3"})]
    assert content == "Let me compute.  Then I answer."
    content, calls = llama.parse(f"I call it:<|python_tag|>{CALC}")
    assert (content, len(calls)) == ("I call it:", 1)


def test_braces_in_prose_are_content() -> None:
    for text in (
        "The set {1, 2} has two elements.",
        'A dict like {"a": 1} is not a call.',
        "An unclosed { brace",
        "The answer is 4.",
    ):
        assert llama.parse(text) == (text, [])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"name": "calculator", "parameters": {"expression": "2 +', "not valid JSON"),
        ("<|python_tag|>{not json}", "not valid JSON"),
        ('{"parameters": {"x": 1}}', "has no 'name'"),
        ('{"name": "f", "parameters": [1]}', "must be a JSON object"),
        (f'{CALC}; {{"name": "g", "parameters": ', "not valid JSON"),
    ],
)
def test_malformed_calls(text: str, message: str) -> None:
    _, calls = llama.parse(text)
    assert calls[-1].error is not None and message in calls[-1].error
