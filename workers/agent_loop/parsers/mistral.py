"""`mistral`: Mistral's `[TOOL_CALLS]` calls, in both of its tokenizers' shapes.

- v11 and later: one marker per call, `[TOOL_CALLS]name[ARGS]{...}` (or `name{...}`, and
  `name[CALL_ID]id[ARGS]{...}` with a call id); several calls are several markers.
- before v11: one marker and a JSON array, `[TOOL_CALLS] [{"name": ..., "arguments": {...},
  "id": ...}, ...]` (or a single object).

Text before the first marker, and after a call's JSON, is content. A marker whose call cannot
be read (no name, arguments that are not JSON, an array entry that is not a call) is an error
call. The turn ends on the model's eos (`</s>`), so the format has no stop string of its own.
"""

from __future__ import annotations

import json

from workers.agent_loop.parsers.base import (
    FunctionCall,
    ToolCallParser,
    arguments_call,
    call_from_object,
    register_parser,
)

__all__ = ["MistralToolParser"]


@register_parser("mistral")
class MistralToolParser(ToolCallParser):
    bot = "[TOOL_CALLS]"
    args = "[ARGS]"
    call_id = "[CALL_ID]"
    template_markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        if self.bot not in text:
            return text.strip(), []
        content, *segments = text.split(self.bot)
        pieces = [content]
        calls: list[FunctionCall] = []
        for segment in segments:
            if not segment.strip():
                continue  # repeated markers count as one
            body = segment.lstrip()
            is_json = body[:1] == "{" or (body[:1] == "[" and not body.startswith(self.args))
            found, rest = self._json_calls(body) if is_json else self._named_call(body.rstrip())
            calls.extend(found)
            pieces.append(rest)
        return "".join(pieces).strip(), calls

    def _json_calls(self, body: str) -> tuple[list[FunctionCall], str]:
        """Pre-v11: a JSON array of calls (or one call object), then content."""
        try:
            parsed, end = json.JSONDecoder().raw_decode(body)
        except (ValueError, RecursionError) as exc:
            error = f"the tool calls are not valid JSON ({exc})"
            return [FunctionCall("", body.strip(), error)], ""
        entries = parsed if isinstance(parsed, list) else [parsed]
        raw = body[:end]
        return [call_from_object(entry, raw) for entry in entries], body[end:]

    def _named_call(self, body: str) -> tuple[list[FunctionCall], str]:
        """v11+: `name[ARGS]{...}`, `name[CALL_ID]id[ARGS]{...}` or `name{...}`, then content."""
        cut = min(
            (i for i in (body.find(self.args), body.find(self.call_id), body.find("{")) if i >= 0),
            default=-1,
        )
        if cut <= 0:
            return [FunctionCall("", body, "the tool call has no name and arguments")], ""
        name, rest = body[:cut].strip(), body[cut:]
        call_id = None
        if rest.startswith(self.call_id):
            given, _, rest = rest[len(self.call_id) :].partition(self.args)
            call_id = given.strip() or None
        elif rest.startswith(self.args):
            rest = rest[len(self.args) :]
        rest = rest.lstrip()
        try:
            arguments, end = json.JSONDecoder().raw_decode(rest)
        except (ValueError, RecursionError) as exc:
            error = f"the arguments of {name!r} are not valid JSON ({exc})"
            return [FunctionCall(name, body, error, call_id)], ""
        if not name:
            return [FunctionCall("", body, "the tool call has no name", call_id)], rest[end:]
        return [arguments_call(name, arguments, body, call_id)], rest[end:]
