"""Looking agent loops up by name: the built-in ones, and user loops named by import path.

`get_agent_loop(name, user_loops)` returns the class for `name`: a user loop named in config
(`package.module:ClassName`, loaded only from there; `AgentLoopError(cause="config")` if it
cannot be loaded or is not an `AgentLoopBase`), else a registered one (`cause="unknown_agent"`
naming the known ones otherwise). Importing this module registers the built-in loops.
"""

from __future__ import annotations

from workers.agent_loop import single_turn, tool_agent
from workers.agent_loop.base import AgentLoopBase, registered
from workers.agent_loop.exceptions import AgentLoopError
from workers.imports import import_object

__all__ = ["BUILTIN", "get_agent_loop", "registered"]

BUILTIN = (single_turn.SingleTurnAgentLoop, tool_agent.ToolAgentLoop)


def get_agent_loop(name: str, user_loops: dict[str, str] | None = None) -> type[AgentLoopBase]:
    """The class for `name`: one named in config by import path, or a registered loop."""
    if user_loops and name in user_loops:
        return _import(user_loops[name])
    known = registered()
    try:
        return known[name]
    except KeyError:
        names = ", ".join(sorted({*known, *(user_loops or {})}))
        raise AgentLoopError(
            f"unknown agent_name {name!r} (known: {names})", cause="unknown_agent"
        ) from None


def _import(path: str) -> type[AgentLoopBase]:
    try:
        cls = import_object(path)
    except (ImportError, AttributeError) as exc:
        raise AgentLoopError(f"cannot load agent loop {path!r}: {exc}", cause="config") from exc
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise AgentLoopError(f"{path!r} is not an AgentLoopBase subclass", cause="config")
    return cls
