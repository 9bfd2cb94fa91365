"""The tool contract the agent loops call: `BaseTool`, its OpenAI schema and `ToolResult`.

One tool object serves every trajectory of a worker at once, so all per-trajectory state
lives under an *instance id*:

    instance_id = await tool.create(None, **create_kwargs)   # once per trajectory
    result = await tool.execute(instance_id, {"x": 1})       # any number of times, concurrently
    await tool.release(instance_id)                          # always, also after errors

Invariants:
- `execute` either returns a `ToolResult` or raises `ToolError` (or a subclass); the message
  of a `ToolError` is what the model sees as the tool's (error) response, so it never carries
  a host traceback. Any other exception is a bug of the tool or an infrastructure fault
  (e.g. `SandboxError`) and ends the sample instead of being shown to the model.
- `release` is idempotent and never raises for an unknown instance id.
- `schema` is an OpenAI function-tool schema; `openai_schema()` is its JSON form, ready for
  `tokenizer.apply_chat_template(messages, tools=[...])`.
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.agent_loop.exceptions import ToolArgumentError, ToolError

__all__ = [
    "BaseTool",
    "FunctionSchema",
    "ToolArgumentError",
    "ToolError",
    "ToolResult",
    "ToolSchema",
    "validation_summary",
]

logger = logging.getLogger("rollout.tools")


class FunctionSchema(BaseModel):
    """The `function` part of an OpenAI tool schema; `parameters` is a JSON schema object."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []}
    )


class ToolSchema(BaseModel):
    """`{"type": "function", "function": {"name", "description", "parameters"}}`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionSchema


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One call's outcome: the text the model sees, an optional reward, metrics to log."""

    text: str
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


class BaseTool(ABC):
    """A tool the model can call. Subclasses implement `execute`; most keep the default
    `create`/`release`, which store the create kwargs per instance in `self.instances`.

    `default_schema` (a class attribute) is used when the config gives no `tool_schema`.
    `config` holds the entry's `config:` mapping from the tool YAML; a tool that validates or
    keeps settings from it does so in `setup()`, which the constructor calls last.
    """

    default_schema: ClassVar[ToolSchema | None] = None

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        schema: ToolSchema | Mapping[str, Any] | None = None,
    ) -> None:
        self.config: dict[str, Any] = dict(config or {})
        if schema is None:
            if self.default_schema is None:
                raise ToolError(f"{type(self).__name__} has no schema", tool=type(self).__name__)
            schema = self.default_schema
        self.schema: ToolSchema = (
            schema if isinstance(schema, ToolSchema) else ToolSchema.model_validate(schema)
        )
        self.instances: dict[str, dict[str, Any]] = {}
        self.setup()

    def setup(self) -> None:  # noqa: B027 (a hook: most tools keep no settings)
        """Read `self.config` (raise `ValueError` naming what is wrong); nothing by default."""

    @property
    def name(self) -> str:
        """The name the model calls the tool by."""
        return self.schema.function.name

    def openai_schema(self) -> dict[str, Any]:
        """The schema as plain JSON data (for chat templates)."""
        return self.schema.model_dump(mode="json", exclude_none=True)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start per-trajectory state; returns the instance id (a new uuid when None)."""
        instance_id = instance_id or uuid.uuid4().hex
        self.instances[instance_id] = dict(kwargs)
        return instance_id

    @abstractmethod
    async def execute(self, instance_id: str | None, parameters: Mapping[str, Any]) -> ToolResult:
        """Run one call. Raises `ToolError` for anything the model should be told about."""

    async def release(self, instance_id: str | None) -> None:
        """Drop the instance's state; a no-op for unknown ids."""
        if instance_id is not None:
            self.instances.pop(instance_id, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def validation_summary(error: ValidationError) -> str:
    """One line per problem, `field.path: message`, joined by `; ` (for config errors)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or 'value'}: {item['msg']}"
        for item in error.errors(include_url=False)
    )
