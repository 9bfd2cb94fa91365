"""Misbehaving tools for the corpus: one that raises, one that sleeps, one that returns
megabytes, and two `BaseTool`s that fail outside the `ToolError` contract.

`FunctionTool` turns any exception of a function into a `ToolError` (answered in band); a
`BaseTool` that raises something else is a bug of the tool (or, for `SandboxError`, an
infrastructure fault) and must end the sample, never be shown to the model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from workers.agent_loop.exceptions import SandboxError
from workers.agent_loop.tools.base import BaseTool, FunctionSchema, ToolResult, ToolSchema
from workers.agent_loop.tools.function import function_tool

__all__ = ["BrokenTool", "InfraTool", "corpus_floods", "corpus_raises", "corpus_sleeps"]

_MIB = 1024 * 1024


@function_tool
def corpus_raises(x: int) -> str:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise ValueError(f"corpus tool exploded on {x}")


@function_tool
def corpus_sleeps(seconds: float) -> str:
    """Sleeps (a tool that hangs), then answers.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds} s"


@function_tool
def corpus_floods(megabytes: int) -> str:
    """Returns megabytes of text.

    Args:
        megabytes: How many MiB to return.
    """
    return "A" * (megabytes * _MIB)


def _schema(name: str) -> ToolSchema:
    return ToolSchema(function=FunctionSchema(name=name, description=f"The corpus' {name}."))


class BrokenTool(BaseTool):
    """A tool with a bug: `execute` raises a plain `RuntimeError`, not a `ToolError`."""

    default_schema = _schema("corpus_broken")

    async def execute(self, instance_id: str | None, parameters: Mapping[str, Any]) -> ToolResult:
        raise RuntimeError("corpus tool bug: list index out of range")


class InfraTool(BaseTool):
    """A tool whose infrastructure is missing: raises `SandboxError` (an `AgentLoopError`)."""

    default_schema = _schema("corpus_infra")

    async def execute(self, instance_id: str | None, parameters: Mapping[str, Any]) -> ToolResult:
        raise SandboxError("corpus: user namespaces are not permitted on this host")
