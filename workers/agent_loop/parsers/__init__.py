"""Tool-call parsers: find the tool calls in one assistant turn's decoded text.

Built in, under vLLM's `--tool-call-parser` names: `hermes` (Hermes / Qwen2.5),
`llama3_json` (Llama 3.x), `mistral`, `qwen3_coder` (XML) and `deepseek_v3`; the contract
and the registry are in `workers.agent_loop.parsers.base`, one module per format.

Which parser a worker uses (`agent_loop.tool_parser`, `resolve_parser`):
- a registered name (a user's parser registers with `@register_parser("name")` in a module
  the worker imports, e.g. one of its tools' modules);
- a `package.module:Class` path: the class is imported from there, and must subclass
  `ToolCallParser`;
- unset: the one whose `template_markers` the model's chat template holds, tried in
  `RECOGNITION_ORDER` (the most specific formats first), else `hermes`.
An unknown name or a path that does not load is a `ParserError`, raised when the worker starts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from workers.agent_loop.exceptions import ParserError
from workers.agent_loop.parsers.base import (
    FunctionCall,
    ToolCallParser,
    parser_class,
    register_parser,
    registered_parsers,
)
from workers.agent_loop.parsers.deepseek_v3 import DeepSeekV3ToolParser
from workers.agent_loop.parsers.hermes import HermesToolParser
from workers.agent_loop.parsers.llama3_json import Llama3JsonToolParser
from workers.agent_loop.parsers.mistral import MistralToolParser
from workers.agent_loop.parsers.qwen3_coder import Qwen3CoderToolParser
from workers.imports import import_object

__all__ = [
    "BUILTIN",
    "RECOGNITION_ORDER",
    "DeepSeekV3ToolParser",
    "FunctionCall",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "Qwen3CoderToolParser",
    "ToolCallParser",
    "get_parser",
    "parser_for_template",
    "register_parser",
    "registered_parsers",
    "resolve_parser",
]

log = logging.getLogger("rollout.tools.parser")

BUILTIN = (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3CoderToolParser,
    DeepSeekV3ToolParser,
)

# Formats whose markers contain another's come first: Qwen3-Coder's templates also hold
# `<tool_call>`; a Llama template's `"parameters"` is the least specific marker.
RECOGNITION_ORDER = ("deepseek_v3", "mistral", "qwen3_coder", "hermes", "llama3_json")
DEFAULT = "hermes"


def get_parser(name: str, tools: Sequence[Mapping[str, Any]] = ()) -> ToolCallParser:
    """A parser instance by registered name (or import path), for the offered tool schemas."""
    return resolve_parser(name, None)(tools)


def parser_for_template(template: str | None) -> str | None:
    """The built-in parser whose format a chat template is written for; None if none is."""
    if not isinstance(template, str):
        return None
    return next((n for n in RECOGNITION_ORDER if parser_class(n).recognises(template)), None)


def resolve_parser(spec: str | None, template: str | None) -> type[ToolCallParser]:
    """`agent_loop.tool_parser` → the parser class: a registered name, a `pkg.mod:Class` path,
    or None: recognised from the chat template, else `hermes` (said in the log)."""
    if spec is None:
        name = parser_for_template(template)
        if name is None:
            log.warning(
                "no tool-call format recognised in the chat template: using %r "
                "(set agent_loop.tool_parser to choose one)",
                DEFAULT,
            )
        return parser_class(name or DEFAULT)
    if ":" not in spec:
        return parser_class(spec)
    try:
        cls = import_object(spec)
    except (ImportError, AttributeError) as exc:
        raise ParserError(f"cannot load tool-call parser {spec!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        raise ParserError(f"tool-call parser {spec!r} is not a ToolCallParser subclass")
    return cls
