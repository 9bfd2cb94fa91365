"""`hermes`: Hermes / Qwen2.5 calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Every closed block is one call, in order (a bad one becomes an error call); text outside the
blocks is content. A block with `parameters` instead of `arguments` is read as its arguments.
A last block left open at the end of the text counts only if its JSON is a complete, valid
call: the model may have stopped on `</tool_call>` with the stop string cut off; an
incomplete one is content.
"""

from __future__ import annotations

import logging
import re

from workers.agent_loop.parsers.base import (
    FunctionCall,
    ToolCallParser,
    call_from_json,
    register_parser,
)

__all__ = ["HermesToolParser"]

logger = logging.getLogger("rollout.tools.parser")


@register_parser("hermes")
class HermesToolParser(ToolCallParser):
    start = "<tool_call>"
    end = "</tool_call>"
    stop_strings = ("</tool_call>",)
    template_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        pieces, calls, rest = self.split_blocks(
            text, self._block, lambda b: call_from_json(b.strip())
        )
        opened = rest.rfind(self.start)
        if opened >= 0:
            tail = call_from_json(rest[opened + len(self.start) :].strip())
            if tail.error is None:
                calls.append(tail)
                rest = rest[:opened]
        pieces.append(rest)
        for call in calls:
            if call.error:
                logger.debug("malformed tool call: %s", call.error)
        return "".join(pieces).strip(), calls
