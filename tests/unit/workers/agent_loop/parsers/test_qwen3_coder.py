"""`qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…` calls."""

from __future__ import annotations

from workers.agent_loop.parsers import FunctionCall, Qwen3CoderToolParser

CALC = (
    "<tool_call>\n<function=calculator>\n<parameter=expression>\n2 + 3\n</parameter>\n"
    "</function>\n</tool_call>"
)
SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "top_k": {"type": "integer"},
                "threshold": {"type": "number"},
                "exact": {"type": "boolean"},
                "filters": {"type": "object"},
                "tags": {"type": "array"},
            },
        },
    },
}
qwen = Qwen3CoderToolParser()


def test_no_call() -> None:
    assert qwen.parse("The answer is 5.") == ("The answer is 5.", [])
    assert qwen.parse("a <tool_call> without a function") == (
        "a <tool_call> without a function",
        [],
    )


def test_one_call() -> None:
    assert qwen.parse(CALC) == ("", [FunctionCall("calculator", {"expression": "2 + 3"})])


def test_two_calls_with_text_around() -> None:
    text = f"First this.\n{CALC}\n{CALC.replace('2 + 3', '4 * 5')}\nThen that."
    content, calls = qwen.parse(text)
    assert calls == [
        FunctionCall("calculator", {"expression": "2 + 3"}),
        FunctionCall("calculator", {"expression": "4 * 5"}),
    ]
    assert content == "First this.\n\n\nThen that."


def test_values_follow_the_tools_schema() -> None:
    text = (
        "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
        "<parameter=top_k>\n3\n</parameter>\n<parameter=threshold>\n0.5\n</parameter>\n"
        '<parameter=exact>\nTrue\n</parameter>\n<parameter=filters>\n{"a": 1}\n</parameter>\n'
        '<parameter=tags>\n["x"]\n</parameter>\n<parameter=other>\n7\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    _, calls = Qwen3CoderToolParser([SCHEMA]).parse(text)
    assert calls == [
        FunctionCall(
            "search",
            {
                "query": "42",  # a string stays a string, digits or not
                "top_k": 3,
                "threshold": 0.5,
                "exact": True,
                "filters": {"a": 1},
                "tags": ["x"],
                "other": "7",  # not in the schema: text
            },
        )
    ]
    # Without the schema every value is text; a value that does not convert stays text.
    assert qwen.parse(text)[1][0].arguments["top_k"] == "3"
    bad = text.replace("\n3\n", "\nthree\n")
    assert Qwen3CoderToolParser([SCHEMA]).parse(bad)[1][0].arguments["top_k"] == "three"


def test_a_multiline_value_keeps_its_inner_lines() -> None:
    code = (
        "<tool_call>\n<function=run>\n<parameter=code>\nx = 1\nprint(x)\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert qwen.parse(code)[1] == [FunctionCall("run", {"code": "x = 1\nprint(x)"})]


def test_malformed_calls() -> None:
    _, calls = qwen.parse('<tool_call>\n{"name": "calculator"}\n</tool_call>')
    assert calls[0].error is not None and "no <function=NAME>" in calls[0].error
    _, calls = qwen.parse("<tool_call>\n<function=>\n</function>\n</tool_call>")
    assert calls[0].error is not None and "no function name" in calls[0].error


def test_unclosed_last_block() -> None:
    # Stopped with `</tool_call>` cut off: the complete function is still a call.
    assert qwen.parse(CALC.removesuffix("</tool_call>"))[1] == [
        FunctionCall("calculator", {"expression": "2 + 3"})
    ]
    # Cut off inside the function: content.
    text = "<tool_call>\n<function=calculator>\n<parameter=expression>\n2 +"
    assert qwen.parse(text) == (text, [])
