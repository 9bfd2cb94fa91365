"""The model's chat format as the agent loops use it: prompts, stop tokens, tool blocks.

Built once per worker from the tokenizer (and the model directory it was loaded from), and
shared by every trajectory:

    chat = ChatFormat.load(tokenizer, tool_parser=None, template_kwargs={})
    chat.prompt_ids(messages, tools)          # the chat template, applied once per trajectory
    chat.stop_ids(tool_calls=True)            # end of turn, every eos, the parser's stops
    chat.cut(token_ids)                       # where a stop string that is no token ends a turn
    chat.tool_block_ids(messages, tools, tool_messages, ended_by)   # what follows a call turn

Where each comes from; no special-token string is written here:
- eos: the tokenizer's `eos_token_id` and every `eos_token_id` of the model directory's
  `config.json` and `generation_config.json`.
- end of turn: the text the template writes after an assistant message's content, found by
  rendering a conversation that ends in an assistant turn whose content is a marker; its first
  token, when that is one added or special token (ChatML's, Llama 3's end-of-turn token), is a
  stop token too.
- parser stops: each of the parser's `stop_strings` that is one token is a stop token; one
  that is not (the tokenizer has no such token) is a stop string: the replica contract stops
  on token ids only, so the loop cuts the turn after the token that completes the string and
  drops what the replica generated past it (`cut`).
- tool block: the template renders the prompt's messages, an assistant turn (the marker) and
  the tool messages, with the generation prompt; the text after the marker is exactly what
  the template puts between that turn and the next generation prompt. Of its start, the
  turn's end, the part the model already generated (when it stopped on the end-of-turn token)
  is dropped; the rest is tokenized on its own and appended with mask 0. The turns so far
  are never re-tokenized, and a default system prompt that a template injects at the start of
  a conversation stays where it is, in the prompt.
- `template_kwargs` (`agent_loop.chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) reach
  every rendering.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from workers.agent_loop.exceptions import AgentLoopError
from workers.agent_loop.parsers import ToolCallParser, resolve_parser

__all__ = ["ChatFormat"]

log = logging.getLogger("rollout.agent_loop.chat_format")

# Stands for an assistant turn's content while the template is rendered: text no template
# changes (no spaces to trim, no markup) and no conversation holds.
MARK = "ROLLOUT-ASSISTANT-TURN-8d1c"
_PROBE = [{"role": "user", "content": "1 + 1"}]
_PROBE_TOOL = [{"role": "tool", "content": "2", "name": "calculator"}]

Messages = Sequence[Mapping[str, Any]]

# What rendering a template the loop did not write can raise: its own `raise_exception`
# (TemplateError), or a message shape it does not expect.
_TEMPLATE_ERRORS = (AgentLoopError, TemplateError, ValueError, TypeError, LookupError)


class ChatFormat:
    """A tokenizer's chat template, end-of-turn and stop tokens, and its tool-call parser."""

    def __init__(
        self,
        tokenizer: Any,
        parser: type[ToolCallParser],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.parser = parser
        self.template_kwargs = dict(template_kwargs or {})
        self.eos_ids = frozenset(_eos_ids(tokenizer))
        self.turn_end = self._probe_turn_end()
        self.end_of_turn_id = self._leading_added_token(self.turn_end)
        self.parser_stop_ids: frozenset[int] = frozenset()
        self.stop_strings: tuple[str, ...] = ()
        ids, strings = set(), []
        for text in parser.stop_strings:
            tokens = tokenizer.encode(text, add_special_tokens=False)
            if len(tokens) == 1:
                ids.add(tokens[0])
            else:
                strings.append(text)
        self.parser_stop_ids, self.stop_strings = frozenset(ids), tuple(strings)
        if strings:
            log.info("no single token for stop strings %s: turns are cut there", strings)

    @classmethod
    def load(
        cls,
        tokenizer: Any,
        *,
        tool_parser: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatFormat:
        """The format of `tokenizer`, with the parser `tool_parser` names (a registered name,
        a `pkg.mod:Class` path, or None: recognised from the chat template). `ParserError` for
        a parser that cannot be found."""
        template = getattr(tokenizer, "chat_template", None)
        return cls(tokenizer, resolve_parser(tool_parser, template), template_kwargs)

    # --- rendering ----------------------------------------------------------------------

    def render(
        self, messages: Messages, tools: Sequence[Mapping[str, Any]] | None = None, *, gen: bool
    ) -> str:
        """The template's text for `messages` (with the generation prompt when `gen`)."""
        return str(
            self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=gen,
                tokenize=False,
                **self.template_kwargs,
            )
        )

    def prompt_ids(
        self, messages: Messages, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The conversation tokenized once, with the generation prompt: a trajectory's prompt."""
        ids = self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=True,
            **self.template_kwargs,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def tool_block_ids(
        self,
        messages: Messages,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_messages: Messages,
        ended_by: str | None,
    ) -> list[int]:
        """The tokens that follow an assistant turn with calls: the rest of the turn's end,
        the tool messages and the next generation prompt, as the template renders them after
        `messages` (the prompt's) and that turn. `ended_by` is the text that ended the turn
        (its stop token's, or a stop string); None if it was not stopped."""
        turn = [*messages, {"role": "assistant", "content": MARK}]
        closed = _after_mark(self.render(turn, tools, gen=False))
        following = _after_mark(self.render([*turn, *tool_messages], tools, gen=True))
        if not following.startswith(closed):
            raise AgentLoopError(
                "the chat template ends an assistant turn differently once tool results follow "
                f"it ({closed!r} vs {following[: len(closed)]!r}): tool responses cannot be "
                "appended to the turns as generated",
                cause="chat_template",
            )
        done = 0
        if ended_by:
            at = closed.find(ended_by)
            done = at + len(ended_by) if at >= 0 else 0
        text = closed[done:] + following[len(closed) :]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # --- stopping -----------------------------------------------------------------------

    def stop_ids(self, *, ignore_eos: bool = False, tool_calls: bool = False) -> list[int]:
        """Token ids a turn stops on: the end-of-turn token and every eos (unless
        `ignore_eos`, which asks for turns past the end), and with `tool_calls` the parser's
        stop tokens."""
        ids = set(self.parser_stop_ids) if tool_calls else set()
        if not ignore_eos:
            ids |= self.eos_ids
            if self.end_of_turn_id is not None:
                ids.add(self.end_of_turn_id)
        return sorted(ids)

    def cut(self, token_ids: Sequence[int]) -> tuple[int, str] | None:
        """(tokens to keep, the stop string) when a stop string occurs in the decoded tokens:
        the shortest prefix whose text holds it; None when none occurs."""
        if not self.stop_strings:
            return None

        def found(n: int) -> str | None:
            text = self.tokenizer.decode(list(token_ids[:n]), skip_special_tokens=False)
            return next((s for s in self.stop_strings if s in text), None)

        if found(len(token_ids)) is None:
            return None
        low, high = 1, len(token_ids)  # found(high) holds: find the smallest such n
        while low < high:
            middle = (low + high) // 2
            if found(middle) is None:
                low = middle + 1
            else:
                high = middle
        stop = found(low)
        assert stop is not None
        return low, stop

    def text_of(self, token_id: int) -> str:
        """One token's text, special or not (what ended a turn)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    # --- probing the template -----------------------------------------------------------

    def _probe_turn_end(self) -> str:
        """The text after an assistant message's content; '' when the template writes nothing
        after it or cannot render the probe (said in the log, as a template that cannot
        render tool results after a turn is: `tool_agent` would fail its samples)."""
        turn = [*_PROBE, {"role": "assistant", "content": MARK}]
        try:
            ended = _after_mark(self.render(turn, gen=False))
        except _TEMPLATE_ERRORS as exc:
            log.warning("no end of an assistant turn found in the chat template (%s)", exc)
            return ""
        try:
            self.tool_block_ids(_PROBE, None, _PROBE_TOOL, None)
        except _TEMPLATE_ERRORS as exc:
            log.warning("the chat template cannot render tool results after a turn (%s)", exc)
        return ended

    def _leading_added_token(self, text: str) -> int | None:
        """The id of the added or special token `text` starts with, if any (the longest)."""
        added: Mapping[str, int] = self.tokenizer.get_added_vocab()
        starts = [token for token in added if token and text.startswith(token)]
        return added[max(starts, key=len)] if starts else None


def _after_mark(text: str) -> str:
    at = text.rfind(MARK)
    if at < 0:
        raise AgentLoopError(
            "the chat template does not render an assistant message's content",
            cause="chat_template",
        )
    return text[at + len(MARK) :]


def _eos_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's eos and every eos_token_id of its directory's config files."""
    ids: set[int] = set()
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        ids.add(tokenizer.eos_token_id)
    directory = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            given = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for value in given if isinstance(given, list) else [given]:
            if isinstance(value, int):
                ids.add(value)
    return ids
