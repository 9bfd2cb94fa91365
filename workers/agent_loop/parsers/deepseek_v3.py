"""`deepseek_v3`: DeepSeek-V3's calls, between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": ...}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>…<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Every `<｜tool▁call▁begin｜>…<｜tool▁call▁end｜>` after the calls marker is one call, in order;
the text before the marker (and after the closing one) is content. A call not in the shape
`type<｜tool▁sep｜>name`, a fenced JSON block, or whose JSON is not an object, is an error call.
The turn stops on `<｜tool▁calls▁end｜>`.
"""

from __future__ import annotations

import re

from workers.agent_loop.parsers.base import (
    FunctionCall,
    ToolCallParser,
    arguments_call,
    register_parser,
)

__all__ = ["DeepSeekV3ToolParser"]


@register_parser("deepseek_v3")
class DeepSeekV3ToolParser(ToolCallParser):
    calls_begin = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    stop_strings = ("<｜tool▁calls▁end｜>",)
    template_markers = ("<｜tool▁calls▁begin｜>", "```json")
    _call_block = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    _shape = re.compile(
        r"\s*(?P<type>[^\n]*?)<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n(?P<args>.*)\n```\s*",
        re.DOTALL,
    )

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        begin = text.find(self.calls_begin)
        if begin < 0:
            return text.strip(), []
        body = text[begin + len(self.calls_begin) :]
        body, _, after = body.partition(self.calls_end)
        calls = [self._call(match.group(1)) for match in self._call_block.finditer(body)]
        return (text[:begin] + after).strip(), calls

    def _call(self, block: str) -> FunctionCall:
        shape = self._shape.fullmatch(block)
        if shape is None:
            return FunctionCall(
                "", block, "the tool call is not 'type<｜tool▁sep｜>name' and a ```json block"
            )
        name = shape.group("name").strip()
        if not name:
            return FunctionCall("", block, "the tool call has no name")
        return arguments_call(name, shape.group("args"), block)
