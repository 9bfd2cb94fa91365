"""Tools: function-tool schemas and validation, the tool YAML, the calculator."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from workers.agent_loop.exceptions import (
    AgentLoopError,
    ToolArgumentError,
    ToolConfigError,
    ToolError,
)
from workers.agent_loop.tools import BaseTool, FunctionTool, ToolResult, function_tool, load_tools
from workers.agent_loop.tools.calculator import CalculatorConfig, CalculatorTool, evaluate
from workers.agent_loop.tools.function import parse_docstring

# --- functions the config tests load by import path ---------------------------------------


def lookup(key: str, upper: bool = False) -> str:
    """Look a key up.

    Args:
        key: What to look up.
        upper: Upper-case the answer.
    """
    return key.upper() if upper else key


@function_tool(name="echo")
async def echo_tool(text: str) -> str:
    """Echo the text back."""
    return text


class NotATool:
    pass


class BrokenTool(BaseTool):
    def __init__(self, config: object = None, schema: object = None) -> None:
        raise RuntimeError("no backend configured")

    async def execute(self, instance_id: str | None, parameters: object) -> ToolResult:
        raise AssertionError


# --- function tools -------------------------------------------------------------------------


class Point(BaseModel):
    x: float
    y: float


async def test_schema_from_signature_and_docstring() -> None:
    @function_tool
    async def search(
        query: str,
        limit: int = 5,
        mode: Literal["fast", "exact"] = "fast",
        tags: list[str] | None = None,
        json: bool = False,
    ) -> list[str]:
        """Search the index for documents.

        Returns the best matches first.

        Args:
            query: Words to look for,
                over two lines.
            limit (int): How many results.
            mode: Search mode.
        Returns:
            Document ids.
        """
        return [query] * limit

    schema = search.openai_schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "search"
    assert function["description"] == "Search the index for documents."
    params = function["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "Words to look for, over two lines."}
    assert props["limit"] == {"type": "integer", "default": 5, "description": "How many results."}
    assert props["mode"]["enum"] == ["fast", "exact"]
    assert props["tags"]["anyOf"] == [
        {"type": "array", "items": {"type": "string"}},
        {"type": "null"},
    ]
    assert props["json"]["type"] == "boolean"  # a name pydantic itself uses still works
    assert "title" not in params and "title" not in props["query"]


def test_parse_docstring_edge_cases() -> None:
    assert parse_docstring(None) == ("", {})
    assert parse_docstring("One line.") == ("One line.", {})
    text = (
        "Summary\nsecond line.\n\nArgs:\n    a: first\n    *b: star\n\nRaises:\n    c: not an arg\n"
    )
    assert parse_docstring(text) == ("Summary second line.", {"a": "first", "b": "star"})


async def test_validation_and_coercion() -> None:
    @function_tool
    def scale(point: Point, factor: float = 2.0) -> dict[str, float]:
        return {"x": point.x * factor, "y": point.y * factor}

    result = await scale.execute(None, {"point": {"x": 1, "y": "2"}, "factor": "3"})
    assert result == ToolResult(text='{"x": 3.0, "y": 6.0}')
    with pytest.raises(ToolArgumentError, match="missing required argument 'point'"):
        await scale.execute(None, {})
    with pytest.raises(ToolArgumentError, match=r"unexpected argument 'z'"):
        await scale.execute(None, {"point": {"x": 1, "y": 2}, "z": 1})
    with pytest.raises(ToolArgumentError, match=r"factor: Input should be a valid number"):
        await scale.execute(None, {"point": {"x": 1, "y": 2}, "factor": "big"})
    with pytest.raises(ToolArgumentError, match="must be a JSON object"):
        await scale.execute(None, ["not", "a", "dict"])  # type: ignore[arg-type]


async def test_errors_of_the_function_become_tool_errors() -> None:
    @function_tool
    def divide(a: int, b: int) -> float:
        return a / b

    @function_tool
    async def refuse() -> str:
        raise ToolError("not today")

    with pytest.raises(ToolError, match="ZeroDivisionError: division by zero") as info:
        await divide.execute(None, {"a": 1, "b": 0})
    assert info.value.tool == "divide" and isinstance(info.value, AgentLoopError)
    with pytest.raises(ToolError, match="not today") as info:
        await refuse.execute(None, {})
    assert info.value.tool == "refuse"


async def test_results_and_instances() -> None:
    @function_tool(name="scored", description="Custom description.")
    async def _scored(answer: str) -> ToolResult:
        return ToolResult(text="ok", reward=1.0 if answer == "42" else 0.0, metrics={"n": 1})

    assert _scored.name == "scored"
    assert _scored.schema.function.description == "Custom description."
    instance = await _scored.create(None, ground_truth="42")
    assert _scored.instances[instance] == {"ground_truth": "42"}
    result = await _scored.execute(instance, {"answer": "42"})
    assert (result.text, result.reward, result.metrics) == ("ok", 1.0, {"n": 1})
    await _scored.release(instance)
    await _scored.release(instance)  # idempotent
    await _scored.release("never-created")
    assert _scored.instances == {}
    assert await echo_tool.create("fixed-id") == "fixed-id"

    def nothing() -> None:
        return None

    assert (await function_tool(nothing).execute(None, {})).text == ""
    with pytest.raises(TypeError, match="invalid schema"):
        function_tool(lambda: None)


def test_unsupported_signatures_are_refused() -> None:
    def variadic(*args: int) -> int:
        return 0

    def positional(a: int, /) -> int:
        return a

    for fn in (variadic, positional):
        with pytest.raises(TypeError, match="must be a named parameter"):
            function_tool(fn)


# --- tool config ------------------------------------------------------------------------------


def test_load_tools_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(
        """
tools:
  - class_name: workers.agent_loop.tools.calculator.CalculatorTool
    config: {max_length: 50}
  - function: tests.unit.workers.agent_loop.tools.test_tools:lookup
  - function: tests.unit.workers.agent_loop.tools.test_tools.echo_tool
  - function: tests.unit.workers.agent_loop.tools.test_tools:echo_tool
    name: echo2
  - class_name: "workers.agent_loop.tools.code_interpreter:CodeInterpreterTool"
    config: {limits: {wall_time_s: 3}}
    tool_schema:
      type: function
      function: {name: python, description: Run Python.,
                 parameters: {type: object, properties: {code: {type: string}}}}
""",
        encoding="utf-8",
    )
    tools = load_tools(path)
    assert list(tools) == ["calculator", "lookup", "echo", "echo2", "python"]
    assert isinstance(tools["calculator"], CalculatorTool)
    assert tools["calculator"].limits.max_length == 50
    assert tools["echo"] is echo_tool
    assert isinstance(tools["echo2"], FunctionTool) and tools["echo2"].fn is echo_tool.fn
    lookup_schema = tools["lookup"].openai_schema()["function"]
    assert lookup_schema["description"] == "Look a key up."
    assert lookup_schema["parameters"]["required"] == ["key"]
    assert tools["python"].schema.function.description == "Run Python."
    assert load_tools({"tools": []}) == {}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"tools": [{"class_name": "no_such_package.mod.Tool"}]}, r"tools\[0\]: cannot import"),
        (
            {"tools": [{"class_name": "workers.agent_loop.tools.calculator.Nope"}]},
            r"tools\[0\]: cannot import .*Nope",
        ),
        (
            {"tools": [{"class_name": "tests.unit.workers.agent_loop.tools.test_tools:NotATool"}]},
            "not a BaseTool subclass",
        ),
        (
            {
                "tools": [
                    {"class_name": "tests.unit.workers.agent_loop.tools.test_tools:BrokenTool"}
                ]
            },
            "no backend configured",
        ),
        (
            {"tools": [{"function": "tests.unit.workers.agent_loop.tools.test_tools:NotATool"}]},
            "not a plain function",
        ),
        ({"tools": [{"function": "math"}]}, "not of the form"),
        ({"tools": [{"config": {}}]}, r"tools\[0\]: .*exactly one of"),
        (
            {
                "tools": [
                    {
                        "function": "tests.unit.workers.agent_loop.tools.test_tools:lookup",
                        "class_name": "x.Y",
                    }
                ]
            },
            "exactly one of",
        ),
        (
            {
                "tools": [
                    {"function": "tests.unit.workers.agent_loop.tools.test_tools:lookup", "typo": 1}
                ]
            },
            r"tools\[0\]: typo",
        ),
        (
            {
                "tools": [
                    {"function": "tests.unit.workers.agent_loop.tools.test_tools:lookup"},
                    {"function": "tests.unit.workers.agent_loop.tools.test_tools:lookup"},
                ]
            },
            r"tools\[1\]: a tool named 'lookup' is already defined",
        ),
        (
            {
                "tools": [
                    {
                        "class_name": "workers.agent_loop.tools.calculator.CalculatorTool",
                        "config": {"max_length": -1},
                    }
                ]
            },
            r"tools\[0\]: cannot build .*max_length",
        ),
        ({"tools": "calculator"}, "tools: Input should be a valid list"),
    ],
)
def test_bad_configs_name_the_entry(config: dict[str, object], message: str) -> None:
    with pytest.raises(ToolConfigError, match=message) as info:
        load_tools(config)
    assert info.value.cause == "tool_config"


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ToolConfigError, match="cannot read tool config"):
        load_tools(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("tools: [", encoding="utf-8")
    with pytest.raises(ToolConfigError, match="not valid YAML"):
        load_tools(broken)
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    assert load_tools(empty) == {}


# --- calculator -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("-(3 - 5)", 2),
        ("+4", 4),
        ("sqrt(16) + abs(-2)", 6.0),
        ("round(3.14159, 2)", 3.14),
        ("min(3, 1, 2) + max(1, 5)", 6),
        ("floor(2.7) + ceil(2.1)", 5),
        ("log(e)", 1.0),
        ("log(8, 2)", 3.0),
        ("2 * pi", 2 * math.pi),
        ("1_000 + 0.5e1", 1005.0),
        ("3 ** 2000 % 1000", pow(3, 2000, 1000)),
    ],
)
def test_calculator_values(expression: str, expected: float) -> None:
    assert evaluate(expression) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unknown function"),
        ("x + 1", "unknown name 'x'"),
        ("(1).__class__", "Attribute is not allowed"),
        ("[1, 2][0]", "Subscript is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("import os", "not a valid expression"),
        ("open('/etc/passwd')", "unknown function"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("[x for x in range(3)]", "ListComp is not allowed"),
        ("max(*[1, 2])", "positional arguments only"),
        ("round(2.5, ndigits=1)", "positional arguments only"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("9 ** 9 ** 9", "result too large"),
        ("2 ** 5000", "result too large"),
        ("10 ** 1000 * 10 ** 1000", "result too large"),
        ("2.0 ** 100000", "cannot evaluate"),
        ("exp(1000)", "cannot evaluate"),
        ("(-8) ** 0.5", "not a real number"),
        ("sqrt(-1)", "cannot evaluate"),
        ("1 / 0", "division by zero"),
        ("round(1.5, 1000)", "digits must be"),
        ("1 +", "not a valid expression"),
        ("", "empty"),
        ("1+" * 200 + "1", "longer than"),
        ("sqrt()", "takes 1..1 arguments"),
    ],
)
def test_calculator_rejects(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_calculator_node_cap() -> None:
    with pytest.raises(ToolError, match="more than 20 parts"):
        evaluate("1+1+1+1+1+1+1+1+1+1+1+1", CalculatorConfig(max_nodes=20))


async def test_calculator_tool() -> None:
    tool = CalculatorTool()
    assert tool.name == "calculator"
    assert tool.openai_schema()["function"]["parameters"]["required"] == ["expression"]
    assert (await tool.execute(None, {"expression": "6 * 7"})).text == "42"
    assert (await tool.execute(None, {"expression": "4 / 2"})).text == "2"
    assert (await tool.execute(None, {"expression": "1 / 3"})).text == repr(1 / 3)
    with pytest.raises(ToolArgumentError, match="expression"):
        await tool.execute(None, {"expr": "1"})
    with pytest.raises(ToolError, match="unknown name"):
        await tool.execute(None, {"expression": "os"})
