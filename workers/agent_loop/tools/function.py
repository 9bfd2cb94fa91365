"""`@function_tool`: a plain (async or sync) Python function as a `BaseTool`.

    @function_tool
    async def add(a: int, b: int = 0) -> int:
        '''Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        '''
        return a + b

The schema comes from the signature and the docstring: type hints become JSON-schema types
(through pydantic, so `list[int]`, `Literal[...]`, `X | None`, pydantic models all work);
parameters with defaults are not required; the docstring's first paragraph is the
description and its Google-style `Args:` entries describe the parameters.

Calls are validated against the signature before the function runs (pydantic, lax mode: the
JSON `"3"` is accepted for an `int`); unknown, missing or mistyped arguments raise
`ToolArgumentError` with one line per problem. What the function returns becomes the tool
response: a `ToolResult` as is, a `str` as the text, anything else as JSON. A `ToolError`
raised by the function reaches the model as is; any other exception is logged with its
traceback and reaches the model as `ToolError("<ExceptionType>: <message>")`.

Sync functions run in a worker thread (`asyncio.to_thread`) so they never block the event
loop; keep them short, a thread cannot be cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import typing
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from workers.agent_loop.exceptions import ToolArgumentError, ToolError
from workers.agent_loop.tools.base import BaseTool, FunctionSchema, ToolResult, ToolSchema

__all__ = ["FunctionTool", "function_tool", "parse_docstring"]

logger = logging.getLogger("rollout.tools")

_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields?|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring.

    The description is the first paragraph with its lines joined; `Args:` entries may wrap
    onto more-indented continuation lines.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        first.append(line.strip())
    args: dict[str, str] = {}
    in_args, current, entry_indent = False, "", -1
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if _SECTION.match(stripped) and indent == 0:
            in_args = stripped.split(":")[0] in ("Args", "Arguments", "Parameters")
            current, entry_indent = "", -1
            continue
        if not in_args or not stripped:
            continue
        if entry_indent < 0:
            entry_indent = indent
        match = _ARG_LINE.match(stripped)
        if indent == entry_indent and match:
            current = match.group("name")
            args[current] = match.group("text").strip()
        elif current and indent > entry_indent:
            args[current] = f"{args[current]} {stripped}".strip()
    return " ".join(first), args


def _strip_titles(node: Any, *, properties: bool = False) -> Any:
    """Drop pydantic's generated `title`s; keys of a `properties` map are names, kept as is."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "title" and not properties and isinstance(value, str):
                continue
            out[key] = _strip_titles(value, properties=key in ("properties", "$defs"))
        return out
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    return node


def _arguments_model(fn: Callable[..., Any], name: str, docs: dict[str, str]) -> type[BaseModel]:
    """A pydantic model of the parameters. Field names are internal (`p_<name>`) with the
    parameter name as alias, so names like `json` or `_x` never clash with pydantic's own."""
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {name!r}: parameter {param.name!r} must be a named parameter")
        default = ... if param.default is param.empty else param.default
        field = Field(default, alias=param.name, description=docs.get(param.name))
        fields[f"p_{param.name}"] = (hints.get(param.name, Any), field)
    config = ConfigDict(extra="forbid", populate_by_name=False)
    model: type[BaseModel] = create_model(f"{name}_arguments", __config__=config, **fields)
    return model


def _describe(name: str, error: ValidationError) -> str:
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"]) or "arguments"
        if item["type"] == "extra_forbidden":
            problems.append(f"unexpected argument {where!r}")
        elif item["type"] == "missing":
            problems.append(f"missing required argument {where!r}")
        else:
            shown = repr(item.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            problems.append(f"{where}: {item['msg']} (got {shown})")
    return f"invalid arguments for tool {name!r}: " + "; ".join(problems)


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


class FunctionTool(BaseTool):
    """A `BaseTool` around one function. `fn` stays callable directly (`tool.fn(...)`)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        config: Mapping[str, Any] | None = None,
        schema: ToolSchema | Mapping[str, Any] | None = None,
    ) -> None:
        tool_name = name or fn.__name__
        summary, docs = parse_docstring(fn.__doc__)
        self.fn = fn
        self._model = _arguments_model(fn, tool_name, docs)
        if schema is None:
            parameters = _strip_titles(self._model.model_json_schema(by_alias=True))
            parameters.setdefault("required", [])
            try:
                function = FunctionSchema(
                    name=tool_name,
                    description=description if description is not None else summary,
                    parameters=parameters,
                )
            except ValidationError as exc:
                problem = exc.errors(include_url=False)[0]["msg"]
                raise TypeError(f"tool {tool_name!r}: invalid schema: {problem}") from exc
            schema = ToolSchema(function=function)
        super().__init__(config=config, schema=schema)

    def validate(self, parameters: Mapping[str, Any]) -> dict[str, Any]:
        """The validated keyword arguments; raises `ToolArgumentError`."""
        if not isinstance(parameters, Mapping):
            raise ToolArgumentError(
                f"arguments for tool {self.name!r} must be a JSON object, "
                f"not {type(parameters).__name__}",
                tool=self.name,
            )
        try:
            model = self._model.model_validate(dict(parameters))
        except ValidationError as exc:
            raise ToolArgumentError(_describe(self.name, exc), tool=self.name) from exc
        # Attribute access (not model_dump) keeps nested models and other values as validated.
        fields = self._model.model_fields
        return {field.alias or key: getattr(model, key) for key, field in fields.items()}

    async def execute(self, instance_id: str | None, parameters: Mapping[str, Any]) -> ToolResult:
        kwargs = self.validate(parameters)
        try:
            if inspect.iscoroutinefunction(self.fn):
                value = await self.fn(**kwargs)
            else:
                value = await asyncio.to_thread(self.fn, **kwargs)
        except ToolError as exc:
            exc.tool = exc.tool or self.name
            raise
        except Exception as exc:  # the function's failure is the model's tool response
            logger.warning("tool %s raised %s", self.name, type(exc).__name__, exc_info=True)
            raise ToolError(f"{type(exc).__name__}: {exc}", tool=self.name) from exc
        if isinstance(value, ToolResult):
            return value
        return ToolResult(text=_as_text(value))


F = typing.TypeVar("F", bound=Callable[..., Any])


@overload
def function_tool(fn: Callable[..., Any], /) -> FunctionTool: ...


@overload
def function_tool(
    *, name: str | None = None, description: str | None = None
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def function_tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Decorator: `@function_tool` or `@function_tool(name=..., description=...)`.

    Raises `TypeError` at decoration time for `*args`, `**kwargs` or positional-only
    parameters (the model passes arguments by name).
    """

    def wrap(target: Callable[..., Any] | Callable[..., Awaitable[Any]]) -> FunctionTool:
        return FunctionTool(target, name=name, description=description)

    return wrap(fn) if fn is not None else wrap
