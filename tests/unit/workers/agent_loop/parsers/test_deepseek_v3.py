"""`deepseek_v3`: calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`."""

from __future__ import annotations

import pytest

from workers.agent_loop.parsers import DeepSeekV3ToolParser, FunctionCall

deepseek = DeepSeekV3ToolParser()


def call(name: str, args: str) -> str:
    fenced = f"\n```json\n{args}\n```"
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}{fenced}<｜tool▁call▁end｜>"


def calls(*blocks: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(blocks) + "<｜tool▁calls▁end｜>"


def test_no_call() -> None:
    assert deepseek.parse("The answer is 5.<｜end▁of▁sentence｜>") == (
        "The answer is 5.<｜end▁of▁sentence｜>",
        [],
    )


def test_one_call() -> None:
    text = calls(call("calculator", '{"expression": "2 + 3"}'))
    assert deepseek.parse(text) == ("", [FunctionCall("calculator", {"expression": "2 + 3"})])


def test_two_calls_with_text_around() -> None:
    text = "Let me compute." + calls(call("a", '{"x": 1}'), call("b", '{"y": [1]}')) + " Done."
    content, found = deepseek.parse(text)
    assert found == [FunctionCall("a", {"x": 1}), FunctionCall("b", {"y": [1]})]
    assert content == "Let me compute. Done."


def test_stopped_on_the_closing_marker() -> None:
    # The loop stops on `<｜tool▁calls▁end｜>`: the text ends with it.
    text = "<｜tool▁calls▁begin｜>" + call("f", "{}") + "<｜tool▁calls▁end｜>"
    assert deepseek.parse(text)[1] == [FunctionCall("f", {})]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (call("f", '{"a": 1'), "not valid JSON"),
        (call("f", "[1, 2]"), "must be a JSON object"),
        (call("", "{}"), "has no name"),
        ("<｜tool▁call▁begin｜>f\n{}<｜tool▁call▁end｜>", "is not 'type<｜tool▁sep｜>name'"),
    ],
)
def test_malformed_calls(block: str, message: str) -> None:
    _, found = deepseek.parse(calls(block))
    assert len(found) == 1 and found[0].error is not None and message in found[0].error
