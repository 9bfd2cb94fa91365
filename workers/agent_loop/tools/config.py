"""The tool YAML: which tools a worker offers, loaded only from the import paths it names.

    tools:
      - class_name: workers.agent_loop.tools.calculator.CalculatorTool   # or "pkg.mod:Class"
        config: {max_length: 200}
      - function: mypkg.tools:lookup          # a plain function, or one already @function_tool'd
        name: lookup_v2                       # optional: rename a function tool
      - class_name: workers.agent_loop.tools.code_interpreter.CodeInterpreterTool
        tool_schema: {...}                    # optional: override the tool's own schema

`load_tools(path_or_mapping)` returns `{name: tool}`. Every failure is a `ToolConfigError`
whose message starts with the entry (`tools[1]: cannot import 'mypkg.tools': ...`): a path
that does not import, an attribute that is missing, a class that is not a `BaseTool`, a
constructor or schema that fails, two tools with one name. Nothing is imported except the
modules named in the file; values are read with `yaml.safe_load`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workers.agent_loop.exceptions import ToolConfigError
from workers.agent_loop.tools.base import BaseTool
from workers.agent_loop.tools.function import FunctionTool
from workers.imports import import_object

__all__ = ["ToolEntry", "ToolsConfig", "import_object", "load_tools"]


class ToolEntry(BaseModel):
    """One tool: exactly one of `class_name` (a `BaseTool` subclass) or `function`."""

    model_config = ConfigDict(extra="forbid")

    class_name: str | None = Field(default=None, description="pkg.mod.Class or pkg.mod:Class.")
    function: str | None = Field(default=None, description="pkg.mod:func or pkg.mod.func.")
    name: str | None = Field(default=None, description="Rename a function tool.")
    config: dict[str, Any] = Field(default_factory=dict, description="The tool's own options.")
    tool_schema: dict[str, Any] | None = Field(
        default=None, description="OpenAI function-tool schema replacing the tool's own."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ToolEntry:
        if (self.class_name is None) == (self.function is None):
            raise ValueError("give exactly one of 'class_name' or 'function'")
        if self.class_name is not None and self.name is not None:
            raise ValueError("'name' renames function tools; use 'tool_schema' for a class")
        return self


class ToolsConfig(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="forbid")

    tools: list[ToolEntry] = Field(default_factory=list)


def _read(source: str | os.PathLike[str] | Mapping[str, Any]) -> ToolsConfig:
    if isinstance(source, Mapping):
        data: Any = dict(source)
    else:
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ToolConfigError(f"cannot read tool config {str(path)!r}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ToolConfigError(f"tool config {str(path)!r} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    try:
        return ToolsConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = first["loc"]
        entry = f"tools[{loc[1]}]" if len(loc) >= 2 and loc[0] == "tools" else ""
        field = ".".join(str(part) for part in loc[2:]) if entry else ".".join(map(str, loc))
        message = f"{field}: {first['msg']}" if field else first["msg"]
        raise ToolConfigError(message, entry=entry) from exc


def _build(entry: ToolEntry, where: str) -> BaseTool:
    path = entry.class_name or entry.function or ""
    try:
        obj = import_object(path)
    except Exception as exc:  # a module's import can raise anything; name the entry
        raise ToolConfigError(f"cannot import {path!r}: {exc}", entry=where) from exc
    try:
        if entry.class_name is not None:
            if not (isinstance(obj, type) and issubclass(obj, BaseTool)):
                raise ToolConfigError(f"{path!r} is not a BaseTool subclass", entry=where)
            return obj(config=entry.config, schema=entry.tool_schema)
        if isinstance(obj, FunctionTool):
            if entry.name is None and entry.tool_schema is None and not entry.config:
                return obj
            obj = obj.fn
        if isinstance(obj, BaseTool) or not callable(obj) or isinstance(obj, type):
            raise ToolConfigError(f"{path!r} is not a plain function", entry=where)
        return FunctionTool(obj, name=entry.name, config=entry.config, schema=entry.tool_schema)
    except ToolConfigError:
        raise
    except Exception as exc:  # constructor or schema failure: report which entry
        raise ToolConfigError(f"cannot build {path!r}: {exc}", entry=where) from exc


def load_tools(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, BaseTool]:
    """Build every tool of a tool YAML (path) or its parsed mapping; `{name: tool}` in order."""
    config = _read(source)
    tools: dict[str, BaseTool] = {}
    for index, entry in enumerate(config.tools):
        where = f"tools[{index}]"
        tool = _build(entry, where)
        if tool.name in tools:
            raise ToolConfigError(f"a tool named {tool.name!r} is already defined", entry=where)
        tools[tool.name] = tool
    return tools
