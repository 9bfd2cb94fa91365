"""`llama3_json`: Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}`.

The format (vLLM's `llama3_json`): a turn that calls tools is JSON objects, several separated
by `;`, optionally after `<|python_tag|>`; the turn ends on the model's end-of-turn token, so
the format has no stop string of its own. Rules:

- Every JSON object in the text with a `name` and `parameters` (or `arguments`) is a call,
  in order; the text outside them is content (prose before or after the calls, the `;`
  separators dropped).
- At a call position (right after `<|python_tag|>`, at the start of the turn, or after a call
  and its `;`) a `{` that is not a readable call is an error call: the turn was one.
- Anywhere else a brace that starts no call is content: prose may hold braces and JSON.
"""

from __future__ import annotations

import json

from workers.agent_loop.parsers.base import (
    FunctionCall,
    ToolCallParser,
    call_from_object,
    register_parser,
)

__all__ = ["Llama3JsonToolParser"]

_SEPARATORS = " \t\r\n;"


@register_parser("llama3_json")
class Llama3JsonToolParser(ToolCallParser):
    bot = "<|python_tag|>"
    template_markers = ('"parameters"',)

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        decoder = json.JSONDecoder()
        calls: list[FunctionCall] = []
        pieces: list[str] = []
        tag = text.find(self.bot)
        if tag >= 0:
            pieces.append(text[:tag])
            position = tag + len(self.bot)
            expect_call = True
        else:
            position = 0
            expect_call = text.lstrip().startswith("{")
        search = position
        while (brace := text.find("{", search)) >= 0:
            at_call = expect_call and not text[position:brace].strip(_SEPARATORS)
            try:
                obj, end = decoder.raw_decode(text, brace)
            except (ValueError, RecursionError) as exc:
                if at_call:
                    raw = text[brace:].strip()
                    calls.append(FunctionCall("", raw, f"the tool call is not valid JSON ({exc})"))
                    position = len(text)
                    break
                search = brace + 1
                continue
            is_call = (
                isinstance(obj, dict)
                and "name" in obj
                and ("parameters" in obj or "arguments" in obj)
            )
            if is_call or at_call:
                pieces.append(text[position:brace])
                calls.append(call_from_object(obj, text[brace:end]))
                position = end
                expect_call = True
            search = end
        pieces.append(text[position:])
        content = "".join(p for p in pieces if p.strip(_SEPARATORS)) if calls else text
        return content.strip(), calls
