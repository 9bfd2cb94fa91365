"""The tool-call parser contract, its registry and the call decoding every format shares.

A parser reads the tool calls of one assistant turn's decoded text (`skip_special_tokens=False`,
so a format's markers are in it); the turn's tokens are kept as generated and never
re-tokenized. A parser is built per trajectory with the tool schemas offered to it (a format
whose values are text, as Qwen3-Coder's, converts them by each parameter's JSON type):

    parser = get_parser("hermes", tools=[calculator.openai_schema()])
    content, calls = parser.parse(text)          # calls: list[FunctionCall], in order
    parser.stop_strings                          # ("</tool_call>",): strings that end a turn
                                                 # with calls; the loop stops on each

Invariant: `parse` never raises on model output. A call that cannot be understood (invalid
JSON, no name, arguments that are not an object) comes back as a `FunctionCall` with `error`
set and the raw text in `arguments`, so the loop answers it with an error tool response and
the trajectory goes on. `content` is the text with the call blocks removed, stripped.

Parsers register by name with `@register_parser("name")` (vLLM's `--tool-call-parser` names
for the built-in formats); `parser_class` raises `ParserError` for an unknown name.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from workers.agent_loop.exceptions import ParserError

__all__ = [
    "FunctionCall",
    "ToolCallParser",
    "arguments_call",
    "call_from_json",
    "call_from_object",
    "parser_class",
    "register_parser",
    "registered_parsers",
]

_PARSERS: dict[str, type[ToolCallParser]] = {}


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """One tool call. With `error` set, `name` may be empty and `arguments` is the raw text.

    `id` is the call id when the format carries one (Mistral's), else None.
    """

    name: str
    arguments: dict[str, Any] | str
    error: str | None = None
    id: str | None = None


class ToolCallParser(ABC):
    """Extracts tool calls from decoded assistant text.

    A user's parser subclasses this, implements `parse`, and is named in config by import path
    (`agent_loop.tool_parser: "pkg.mod:MyParser"`) or registered with `@register_parser`.
    """

    name: ClassVar[str] = ""
    stop_strings: ClassVar[tuple[str, ...]] = ()
    """Strings that end a turn with tool calls: the loop stops generation on each (on its token
    when it is one token, else on the decoded text)."""
    template_markers: ClassVar[tuple[str, ...]] = ()
    """Strings that all appear in a chat template written for this format (how the worker picks
    a parser when `agent_loop.tool_parser` is not set); empty: never picked that way."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.parameters: dict[str, dict[str, Any]] = {}
        """Tool name → its JSON-schema `properties`, from the schemas offered."""
        for schema in tools:
            function = schema.get("function", schema)
            name = function.get("name") if isinstance(function, Mapping) else None
            params = function.get("parameters") if isinstance(function, Mapping) else None
            props = params.get("properties") if isinstance(params, Mapping) else None
            if isinstance(name, str) and isinstance(props, Mapping):
                self.parameters[name] = dict(props)

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        """(content without the calls, the calls in order). Never raises on model output."""

    @staticmethod
    def split_blocks(
        text: str, block: re.Pattern[str], to_call: Callable[[str], FunctionCall]
    ) -> tuple[list[str], list[FunctionCall], str]:
        """Every whole `block` of `text` made a call (`to_call` of its first group): the text
        between them, the calls in order, and what follows the last block (an unclosed one,
        which a subclass may still read as a call)."""
        calls: list[FunctionCall] = []
        pieces: list[str] = []
        position = 0
        for match in block.finditer(text):
            pieces.append(text[position : match.start()])
            calls.append(to_call(match.group(1)))
            position = match.end()
        return pieces, calls, text[position:]

    @classmethod
    def recognises(cls, template: str) -> bool:
        """Whether a chat template is written for this format (all `template_markers` in it)."""
        return bool(cls.template_markers) and all(m in template for m in cls.template_markers)


P = TypeVar("P", bound=type[ToolCallParser])


def register_parser(name: str) -> Callable[[P], P]:
    """Class decorator registering a parser under `name` (a second registration is an error)."""

    def register(cls: P) -> P:
        if name in _PARSERS and _PARSERS[name] is not cls:
            raise ParserError(f"tool-call parser {name!r} is registered twice")
        cls.name = name
        _PARSERS[name] = cls
        return cls

    return register


def parser_class(name: str) -> type[ToolCallParser]:
    """The parser registered as `name`; `ParserError` names the known ones otherwise."""
    try:
        return _PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(_PARSERS)) or "none"
        raise ParserError(
            f"unknown tool-call parser {name!r} (known: {known}; "
            "or a user parser as 'package.module:Class')"
        ) from None


def registered_parsers() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(_PARSERS)


def call_from_json(raw: str, call_id: str | None = None) -> FunctionCall:
    """One JSON call object's text → a call, or a call with `error`."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return FunctionCall("", raw, f"the tool call is not valid JSON ({exc})")
    return call_from_object(data, raw, call_id)


def call_from_object(data: Any, raw: str, call_id: str | None = None) -> FunctionCall:
    """`{"name": ..., "arguments": {...}}` → a call. `parameters` (Llama's word) is read when
    there is no `arguments`; arguments given as a JSON string are decoded; anything else that
    is not an object becomes a call with `error` and `raw` as its arguments."""
    if not isinstance(data, dict):
        return FunctionCall("", raw, "the tool call must be a JSON object with 'name'")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return FunctionCall("", raw, "the tool call has no 'name'")
    given_id = data.get("id")
    call_id = call_id or (given_id if isinstance(given_id, str) else None)
    key = "arguments" if "arguments" in data else "parameters"
    return arguments_call(name.strip(), data.get(key), raw, call_id)


def arguments_call(name: str, arguments: Any, raw: str, call_id: str | None = None) -> FunctionCall:
    """A call to `name` with `arguments` (an object, a JSON string of one, or None for none)."""
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return FunctionCall(
                name, raw, f"the arguments of {name!r} are not valid JSON ({exc})", call_id
            )
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return FunctionCall(name, raw, f"the arguments of {name!r} must be a JSON object", call_id)
    return FunctionCall(name, arguments, None, call_id)
