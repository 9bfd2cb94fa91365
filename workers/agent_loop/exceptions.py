"""Errors of the agent loops, their tools and tool-call parsers.

    RolloutError (schemas.errors)
    └── AgentLoopError                every error of workers.agent_loop
        ├── ToolError                 one tool call failed; the message becomes the error
        │   │                         tool response the model sees, the trajectory goes on
        │   └── ToolArgumentError     the call's arguments do not match the tool's signature
        ├── ToolConfigError           a tool config entry cannot be loaded (names the entry)
        ├── SandboxError              the code sandbox cannot be set up: an infrastructure
        │                             fault, not the model's; fail the trajectory, do not
        │                             answer the model with it
        └── ParserError               an unknown tool-call parser name

A malformed tool call in the model's text (bad JSON, no name) is *not* an exception: the
parser returns it as a `FunctionCall` with `error` set, so the loop can answer it in band.
"""

from __future__ import annotations

from schemas.errors import RolloutError

__all__ = [
    "AgentLoopError",
    "ParserError",
    "SandboxError",
    "ToolArgumentError",
    "ToolConfigError",
    "ToolError",
]


class AgentLoopError(RolloutError):
    """Root of the errors of `workers.agent_loop`.

    `cause` is a short machine-readable reason (`config`, `tool_config`, `sandbox`, ...) that
    the worker puts in the dead-letter headers when the error ends a sample.
    """

    def __init__(self, message: str, *, cause: str = "agent_loop") -> None:
        super().__init__(message)
        self.cause = cause


class ToolError(AgentLoopError):
    """A tool call failed. `str(err)` is safe to show the model as the tool's response.

    `tool` names the tool (empty when unknown); the message never holds a host traceback.
    """

    def __init__(self, message: str, *, tool: str = "") -> None:
        super().__init__(message, cause="tool")
        self.tool = tool


class ToolArgumentError(ToolError):
    """The arguments of a call do not validate against the tool's parameters."""


class ToolConfigError(AgentLoopError):
    """A tool config (or one entry of it) is invalid; `entry` says which, e.g. `tools[2]`."""

    def __init__(self, message: str, *, entry: str = "") -> None:
        super().__init__(f"{entry}: {message}" if entry else message, cause="tool_config")
        self.entry = entry


class ParserError(AgentLoopError):
    """No tool-call parser is registered under the requested name."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause="config")


class SandboxError(AgentLoopError):
    """The code sandbox could not be set up (no `unshare`, namespaces refused, ...).

    Deliberately not a `ToolError`: the model did nothing wrong, and answering it with this
    would train on an infrastructure fault.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, cause="sandbox")
