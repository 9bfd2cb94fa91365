"""Tool-call parsers: find the tool calls in one assistant turn's decoded text.

The agent loop decodes the generated token ids to text *only* to read the calls; the tokens
themselves are kept as generated and never re-tokenized. A parser is stateless:

    parser = get_parser("hermes")
    content, calls = parser.parse(text)          # calls: list[FunctionCall], in order
    parser.stop_strings                          # ("</tool_call>",): the loop maps each to a
                                                 # token id and adds it to stop_token_ids

Invariant: `parse` never raises on model output. A call that cannot be understood (invalid
JSON, no name, arguments that are not an object) comes back as a `FunctionCall` with `error`
set and the raw text in `arguments`, so the loop answers it with an error tool response and
the trajectory goes on. `content` is the text with the call blocks removed.

Parsers register by name with `@register_parser("name")`; `get_parser` raises `ParserError`
for an unknown name.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from workers.agent_loop.exceptions import ParserError

__all__ = [
    "FunctionCall",
    "HermesToolParser",
    "ToolCallParser",
    "get_parser",
    "register_parser",
    "registered_parsers",
]

logger = logging.getLogger("rollout.tools.parser")

_PARSERS: dict[str, type[ToolCallParser]] = {}


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """One tool call. With `error` set, `name` may be empty and `arguments` is the raw text."""

    name: str
    arguments: dict[str, Any] | str
    error: str | None = None


class ToolCallParser(ABC):
    """Extracts tool calls from decoded assistant text."""

    name: ClassVar[str] = ""
    stop_strings: ClassVar[tuple[str, ...]] = ()
    """Strings that end a turn with tool calls; the loop adds their token ids as stop tokens."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        """(content without the calls, the calls in order). Never raises on model output."""


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


def get_parser(name: str) -> ToolCallParser:
    """A parser instance by registered name; `ParserError` names the known ones otherwise."""
    try:
        return _PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(_PARSERS)) or "none"
        raise ParserError(f"unknown tool-call parser {name!r} (known: {known})") from None


def registered_parsers() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(_PARSERS)


def _decode_call(raw: str) -> FunctionCall:
    """One `{"name": ..., "arguments": {...}}` object → a call, or a call with `error`."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return FunctionCall("", raw, f"the tool call is not valid JSON ({exc})")
    if not isinstance(data, dict):
        return FunctionCall("", raw, "the tool call must be a JSON object with 'name'")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return FunctionCall("", raw, "the tool call has no 'name'")
    name = name.strip()
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return FunctionCall(name, raw, f"the arguments of {name!r} are not valid JSON ({exc})")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return FunctionCall(name, raw, f"the arguments of {name!r} must be a JSON object")
    return FunctionCall(name, arguments)


@register_parser("hermes")
class HermesToolParser(ToolCallParser):
    """Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    Every closed block is one call (a bad one becomes an error call). A last block left open
    at the end of the text counts only if its JSON is a complete, valid call: the model may
    have stopped on `</tool_call>` with the stop string cut off; an incomplete one is content.
    """

    start = "<tool_call>"
    end = "</tool_call>"
    stop_strings = ("</tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        calls: list[FunctionCall] = []
        pieces: list[str] = []
        position = 0
        for match in self._block.finditer(text):
            pieces.append(text[position : match.start()])
            calls.append(_decode_call(match.group(1).strip()))
            position = match.end()
        rest = text[position:]
        opened = rest.rfind(self.start)
        if opened >= 0:
            tail = _decode_call(rest[opened + len(self.start) :].strip())
            if tail.error is None:
                calls.append(tail)
                rest = rest[:opened]
        pieces.append(rest)
        for call in calls:
            if call.error:
                logger.debug("malformed tool call: %s", call.error)
        return "".join(pieces).strip(), calls
