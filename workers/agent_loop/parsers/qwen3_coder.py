"""`qwen3_coder`: Qwen3-Coder's XML calls.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Every `<tool_call>` block is one call, in order; text outside the blocks is content. A value
is text (one leading and one trailing newline, the template's, are dropped); with the tool's
schema given to the parser it is converted by the parameter's JSON type (integer, number,
boolean, null, object, array), and kept as text when it does not convert (the tool's own
validation then answers) or when the type is a string or unknown. A block without a
`<function=NAME>` is an error call. A last block left open counts when its `</function>` is
there (the model stopped on `</tool_call>` with the stop string cut off).
"""

from __future__ import annotations

import json
import re
from typing import Any

from workers.agent_loop.parsers.base import FunctionCall, ToolCallParser, register_parser

__all__ = ["Qwen3CoderToolParser"]


@register_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolCallParser):
    start = "<tool_call>"
    stop_strings = ("</tool_call>",)
    template_markers = ("<function=", "<parameter=")
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _function = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
    _param = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        pieces, calls, rest = self.split_blocks(text, self._block, self._call)
        opened = rest.rfind(self.start)
        if opened >= 0 and self._function.search(rest, opened):
            calls.append(self._call(rest[opened + len(self.start) :]))
            rest = rest[:opened]
        pieces.append(rest)
        return "".join(pieces).strip(), calls

    def _call(self, block: str) -> FunctionCall:
        function = self._function.search(block)
        if function is None:
            return FunctionCall("", block.strip(), "the tool call has no <function=NAME>")
        name = function.group(1).strip()
        if not name:
            return FunctionCall("", block.strip(), "the tool call has no function name")
        types = self.parameters.get(name, {})
        arguments: dict[str, Any] = {}
        for param in self._param.finditer(function.group(2)):
            key = param.group(1).strip()
            value = param.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[key] = _convert(value, types.get(key))
        return FunctionCall(name, arguments)


def _convert(value: str, schema: Any) -> Any:
    """The value as its parameter's JSON type says; the text itself when it does not convert."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if not isinstance(kind, str) or kind == "string":
        return value
    text = value.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and "." not in text else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            return json.loads(text)
    except (ValueError, RecursionError):
        pass
    return value
