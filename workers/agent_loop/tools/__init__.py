"""Tools for the `tool_agent` loop: the `BaseTool` contract, function tools, the tool YAML.

    from workers.agent_loop.tools import load_tools
    tools = load_tools("tools.yaml")                  # {name: BaseTool}
    schemas = [tool.openai_schema() for tool in tools.values()]
    instance = await tool.create(None)
    result = await tool.execute(instance, arguments)  # ToolResult | raises ToolError
    await tool.release(instance)

Built-in tools (loaded by class path like any other): `calculator.CalculatorTool`,
`code_interpreter.CodeInterpreterTool` (a namespace/rlimit sandbox, see `sandbox.py`).
"""

from workers.agent_loop.exceptions import ToolArgumentError, ToolConfigError, ToolError
from workers.agent_loop.tools.base import BaseTool, FunctionSchema, ToolResult, ToolSchema
from workers.agent_loop.tools.config import load_tools
from workers.agent_loop.tools.function import FunctionTool, function_tool

__all__ = [
    "BaseTool",
    "FunctionSchema",
    "FunctionTool",
    "ToolArgumentError",
    "ToolConfigError",
    "ToolError",
    "ToolResult",
    "ToolSchema",
    "function_tool",
    "load_tools",
]
