"""A calculator tool: arithmetic on numbers, evaluated by walking Python's `ast`.

The expression is parsed with `ast.parse(mode="eval")` and evaluated by an explicit walker
that knows only: int and float literals; `+ - * / // % **`; unary `+`/`-`; parentheses;
calls of a fixed table of functions (`sqrt abs round min max floor ceil log log2 log10 exp
sin cos tan`) with positional arguments; the constants `pi`, `e` and `tau`. Every other node
(names, attributes, subscripts, comprehensions, lambdas, strings, keyword arguments, ...)
is rejected. Nothing the model writes is ever passed to `eval`/`exec`/`compile`.

Size guards, so no expression can take the worker's CPU or memory: the text length and the
number of AST nodes are capped; an integer power is refused when its result would exceed
`max_result_bits` (estimated from the operands *before* computing it), every integer result is
checked against the same cap, and `round` digits are bounded. Failures raise `ToolError`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.agent_loop.exceptions import ToolArgumentError, ToolError
from workers.agent_loop.tools.base import (
    BaseTool,
    FunctionSchema,
    ToolResult,
    ToolSchema,
    validation_summary,
)

__all__ = ["CalculatorConfig", "CalculatorTool", "evaluate"]

Number = int | float


class CalculatorConfig(BaseModel):
    """Limits of one evaluation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_length: int = Field(default=256, ge=1, le=10_000, description="Longest expression.")
    max_nodes: int = Field(default=200, ge=1, le=10_000, description="Most AST nodes.")
    max_result_bits: int = Field(
        default=4096, ge=64, le=1_000_000, description="Largest integer (≈ 1233 digits)."
    )


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}
# name → (function, min args, max args)
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "sqrt": (math.sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (round, 1, 2),
    "min": (min, 1, 32),
    "max": (max, 1, 32),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "log": (math.log, 1, 2),
    "log2": (math.log2, 1, 1),
    "log10": (math.log10, 1, 1),
    "exp": (math.exp, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
}


class _Evaluator:
    def __init__(self, limits: CalculatorConfig) -> None:
        self.limits = limits

    def fail(self, message: str) -> ToolError:
        return ToolError(message, tool="calculator")

    def value(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return self.value(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise self.fail(f"only numbers are allowed, not {node.value!r}")
            return self.checked(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.value(node.left), self.value(node.right)
            if isinstance(node.op, ast.Pow):
                self.check_power(left, right)
            return self.checked(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.checked(_UNARY[type(node.op)](self.value(node.operand)))
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise self.fail(f"unknown name {node.id!r}")
        if isinstance(node, ast.Call):
            return self.call(node)
        raise self.fail(f"{type(node).__name__} is not allowed in an expression")

    def call(self, node: ast.Call) -> Number:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            raise self.fail(f"unknown function; allowed: {', '.join(sorted(_FUNCTIONS))}")
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise self.fail("functions take plain positional arguments only")
        name = node.func.id
        function, low, high = _FUNCTIONS[name]
        if not low <= len(node.args) <= high:
            raise self.fail(f"{name}() takes {low}..{high} arguments, got {len(node.args)}")
        args = [self.value(arg) for arg in node.args]
        if name == "round" and len(args) == 2:
            if not isinstance(args[1], int) or abs(args[1]) > 100:
                raise self.fail("round() digits must be an integer between -100 and 100")
        return self.checked(function(*args))

    def check_power(self, base: Number, exponent: Number) -> None:
        if isinstance(base, int) and isinstance(exponent, int):
            if exponent > 0 and abs(base) > 1:
                bits = (abs(base).bit_length() - 1) * exponent
                if bits > self.limits.max_result_bits:
                    raise self.fail("result too large")
            if abs(exponent) > self.limits.max_result_bits * 64:
                raise self.fail("exponent too large")

    def checked(self, value: Any) -> Number:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"the result is not a real number: {value!r}")
        if isinstance(value, int) and value.bit_length() > self.limits.max_result_bits:
            raise self.fail("result too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail("the result is not finite")
        return value


def evaluate(expression: str, limits: CalculatorConfig | None = None) -> Number:
    """The value of an arithmetic expression; raises `ToolError` for anything else."""
    limits = limits or CalculatorConfig()
    if not isinstance(expression, str):
        raise ToolError("the expression must be a string", tool="calculator")
    expression = expression.strip()
    if not expression:
        raise ToolError("the expression is empty", tool="calculator")
    if len(expression) > limits.max_length:
        raise ToolError(
            f"the expression is longer than {limits.max_length} characters", tool="calculator"
        )
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"not a valid expression: {exc}", tool="calculator") from exc
    if sum(1 for _ in ast.walk(tree)) > limits.max_nodes:
        raise ToolError(f"the expression has more than {limits.max_nodes} parts", tool="calculator")
    try:
        return _Evaluator(limits).value(tree)
    except ZeroDivisionError as exc:
        raise ToolError("division by zero", tool="calculator") from exc
    except (OverflowError, ValueError, TypeError, RecursionError) as exc:
        raise ToolError(f"cannot evaluate: {exc}", tool="calculator") from exc


def _format(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


class CalculatorTool(BaseTool):
    """`calculator(expression)` → the value as text. Config: `CalculatorConfig` fields."""

    default_schema = ToolSchema(
        function=FunctionSchema(
            name="calculator",
            description=(
                "Evaluate an arithmetic expression with + - * / // % ** and parentheses, "
                "the functions sqrt, abs, round, min, max, floor, ceil, log, log2, log10, exp, "
                "sin, cos, tan, and the constants pi, e, tau."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "The expression, e.g. '(3 + 4) * sqrt(2)'.",
                    }
                },
                "required": ["expression"],
            },
        )
    )

    def setup(self) -> None:
        try:
            self.limits = CalculatorConfig.model_validate(self.config)
        except ValidationError as exc:
            raise ValueError(f"invalid calculator config: {validation_summary(exc)}") from exc

    async def execute(self, instance_id: str | None, parameters: Mapping[str, Any]) -> ToolResult:
        expression = parameters.get("expression") if isinstance(parameters, Mapping) else None
        if not isinstance(expression, str):
            raise ToolArgumentError(
                "calculator needs a string argument 'expression'", tool=self.name
            )
        value = evaluate(expression, self.limits)
        return ToolResult(text=_format(value))
