"""`tool_agent`: multi-turn generation with tool calls, as a state machine.

    PENDING ──► GENERATING ──► PROCESSING_TOOLS ──► GENERATING ──► … ──► TERMINATED

- PENDING: the chat template (with the offered tools' schemas) is applied once.
- GENERATING: one assistant turn, token-in/token-out, stopping on the model's end-of-turn
  token, every eos and the tool parser's stop tokens (`ChatFormat.stop_ids`; a stop string
  that is no token cuts the turn after it); tokens get mask 1 and their logprobs. The
  decoded turn is parsed for tool calls (only to read them: the tokens are kept as
  generated).
- PROCESSING_TOOLS: the turn's calls run concurrently (at most `max_parallel_calls`); each
  result becomes a tool message, truncated to `max_tool_response_length` characters
  (left/right/middle), and the tool block's tokens are appended with mask 0: exactly what
  the model's chat template puts between that turn and the next generation prompt (the rest
  of the turn's end if the model stopped on a parser's stop token, the tool responses, the
  generation prompt), tokenized alone (`ChatFormat.tool_block_ids`). An unknown tool,
  invalid JSON arguments or a failing tool become an error tool response to the model, never
  a crash.
- TERMINATED: no tool call, `max_assistant_turns` / `max_user_turns` reached, or the
  response budget spent (finish reason `length`).

Per-sample `extra_info.tool_selection` limits the tools offered to that sample. The whole
trajectory uses one request id, so the router keeps it on one replica (prefix cache).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from workers.agent_loop.base import AgentLoopBase, AgentLoopOutput, TurnRecord, register
from workers.agent_loop.exceptions import AgentLoopError
from workers.llm.contract import GenerateOutput, SamplingParams

__all__ = ["AgentData", "AgentState", "ToolAgentLoop", "truncate"]

log = logging.getLogger("rollout.agent_loop.tool")


class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


@dataclass
class AgentData:
    """The mutable state of one tool-agent trajectory."""

    messages: list[dict[str, Any]]
    request_id: str
    tools: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    context_ids: list[int] = field(default_factory=list)  # prompt + response so far
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    pending_calls: list[Any] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    min_version: int | None = None
    max_version: int | None = None
    finish_reason: str = "stop"
    tool_rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    instances: dict[str, str] = field(default_factory=dict)

    def add(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.context_ids.extend(ids)
        self.response_ids.extend(ids)
        self.response_mask.extend([mask] * len(ids))
        self.response_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """Cut `text` to at most `limit` characters, keeping its left, right or both ends."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "left":
        return text[:keep] + marker
    if side == "right":
        return marker + text[len(text) - keep :]
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Options (`AgentContext.options`): max_assistant_turns, max_user_turns,
    max_parallel_calls, max_tool_response_length, tool_response_truncate_side. The tool-call
    parser is the chat format's (`agent_loop.tool_parser`)."""

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        extra_info = sample.get("extra_info") or {}
        tools = self._select_tools(extra_info)
        self.create_kwargs = _create_kwargs(extra_info, tools)
        self.schemas = [_schema_of(tool) for tool in tools.values()]
        self.parser = self.chat.parser(self.schemas)
        self.prompt_messages = list(sample["messages"])
        self.ended_by: str | None = None  # what ended the last assistant turn
        data = AgentData(
            messages=list(sample["messages"]), request_id=sample["request_id"], tools=tools
        )
        state = AgentState.PENDING
        try:
            while state is not AgentState.TERMINATED:
                if state is AgentState.PENDING:
                    state = await self._pending(data)
                elif state is AgentState.GENERATING:
                    state = await self._generate(data, sampling_params)
                else:
                    state = await self._process_tools(data)
        finally:
            await self._release(data)
        low = data.min_version if data.min_version is not None else 0
        high = data.max_version if data.max_version is not None else low
        return AgentLoopOutput(
            prompt_ids=data.prompt_ids,
            response_ids=data.response_ids,
            response_mask=data.response_mask,
            response_logprobs=data.response_logprobs,
            num_turns=data.assistant_turns + data.user_turns + 1,
            finish_reason=data.finish_reason,
            metrics={
                "tool_calls": data.tool_calls,
                "tool_errors": data.tool_errors,
                "tool_seconds": round(data.tool_seconds, 4),
                "assistant_turns": data.assistant_turns,
            },
            extra_fields={
                "min_global_steps": low,
                "max_global_steps": high,
                "tool_rewards": data.tool_rewards,
            },
        )

    # --- states ---------------------------------------------------------------------

    async def _pending(self, data: AgentData) -> AgentState:
        data.prompt_ids = self.apply_chat_template(data.messages, tools=self.schemas)
        data.context_ids = list(data.prompt_ids)
        for name, tool in data.tools.items():
            data.instances[name] = await tool.create(None, **self.create_kwargs.get(name, {}))
        return AgentState.GENERATING

    async def _generate(self, data: AgentData, sampling_params: SamplingParams) -> AgentState:
        budget = self.ctx.max_response_length - len(data.response_ids)
        if budget <= 0:
            data.finish_reason = "length"
            return AgentState.TERMINATED
        stops = self.chat.stop_ids(ignore_eos=sampling_params.ignore_eos, tool_calls=True)
        params = sampling_params.model_copy(
            update={
                "max_tokens": min(sampling_params.max_tokens, budget),
                "stop_token_ids": sorted({*sampling_params.stop_token_ids, *stops}),
            }
        )
        out = self._stopped(
            await self.ctx.llm.generate(data.request_id, data.context_ids, params),
            len(data.context_ids),
        )
        tokens = list(out.token_ids)
        logprobs = list(out.logprobs) if out.logprobs else [0.0] * len(tokens)
        data.add(tokens, 1, logprobs)
        data.assistant_turns += 1
        data.min_version = (
            out.min_global_steps
            if data.min_version is None
            else min(data.min_version, out.min_global_steps)
        )
        data.max_version = (
            out.max_global_steps
            if data.max_version is None
            else max(data.max_version, out.max_global_steps)
        )
        self._last_version = out.max_global_steps
        await self.ctx.on_turn(
            TurnRecord(
                "assistant",
                tokens,
                logprobs,
                out.min_global_steps,
                out.max_global_steps,
                out.finish_reason,
                prompt_ids=data.prompt_ids if data.assistant_turns == 1 else None,
                routed_experts=out.routed_experts,
            )
        )
        if out.finish_reason == "length" or len(data.response_ids) >= self.ctx.max_response_length:
            data.finish_reason = "length"
            return AgentState.TERMINATED
        text = self.ctx.tokenizer.decode(tokens, skip_special_tokens=False)
        _content, calls = self.parser.parse(text)
        if not calls:
            return AgentState.TERMINATED
        if data.assistant_turns >= int(self.ctx.options.get("max_assistant_turns", 5)):
            return AgentState.TERMINATED
        data.pending_calls = calls
        return AgentState.PROCESSING_TOOLS

    async def _process_tools(self, data: AgentData) -> AgentState:
        calls, data.pending_calls = data.pending_calls, []
        limit = asyncio.Semaphore(int(self.ctx.options.get("max_parallel_calls", 4)))
        started = time.monotonic()

        async def one(call: Any) -> tuple[str, float | None]:
            async with limit:
                return await self._call_tool(data, call)

        results = await asyncio.gather(*(one(c) for c in calls))
        data.tool_seconds += time.monotonic() - started
        tool_messages = []
        side = str(self.ctx.options.get("tool_response_truncate_side", "middle"))
        cap = int(self.ctx.options.get("max_tool_response_length", 256))
        rewards = []
        for call, (text, reward) in zip(calls, results, strict=True):
            message = {"role": "tool", "content": truncate(text, cap, side)}
            if call.name:
                message["name"] = call.name
            if call.id:
                message["tool_call_id"] = call.id
            tool_messages.append(message)
            if reward is not None:
                rewards.append(reward)
        ids = self.chat.tool_block_ids(
            self.prompt_messages, self.schemas, tool_messages, self.ended_by
        )
        if len(data.response_ids) + len(ids) >= self.ctx.max_response_length:
            data.finish_reason = "length"
            return AgentState.TERMINATED
        data.add(ids, 0)
        data.messages.extend(tool_messages)
        data.user_turns += 1
        data.tool_rewards.extend(rewards)
        version = getattr(self, "_last_version", 0)
        await self.ctx.on_turn(
            TurnRecord(
                "tool",
                ids,
                None,
                version,
                version,
                "tool_calls",
                tool_reward=sum(rewards) if rewards else None,
                metrics={"calls": len(calls)},
            )
        )
        if data.user_turns >= int(self.ctx.options.get("max_user_turns", 5)):
            return AgentState.TERMINATED
        return AgentState.GENERATING

    # --- helpers --------------------------------------------------------------------

    async def _call_tool(self, data: AgentData, call: Any) -> tuple[str, float | None]:
        from workers.agent_loop.tools.base import ToolError

        data.tool_calls += 1
        if getattr(call, "error", None):
            data.tool_errors += 1
            return f"Error: {call.error}", None
        tool = data.tools.get(call.name)
        if tool is None:
            data.tool_errors += 1
            return (
                f"Error: unknown tool {call.name!r}; "
                f"available: {', '.join(sorted(data.tools)) or 'none'}",
                None,
            )
        timeout = float(self.ctx.options.get("tool_timeout_s", 60.0))
        try:
            result = await asyncio.wait_for(
                tool.execute(data.instances.get(call.name), call.arguments), timeout
            )
        except ToolError as exc:
            data.tool_errors += 1
            return f"Error: {exc}", None
        except TimeoutError:
            data.tool_errors += 1
            return f"Error: tool {call.name!r} timed out after {timeout:g} s", None
        return result.text, result.reward

    def _stopped(self, out: GenerateOutput, fed: int) -> GenerateOutput:
        """The turn as the loop keeps it, and what ended it (for the tool block): cut after a
        parser's stop string that is no token of its own, since the replica stops on token
        ids only and generated past it; `fed` is the context's length."""
        tokens = list(out.token_ids)
        cut = self.chat.cut(tokens)
        if cut is None:
            stopped = out.finish_reason == "stop" and bool(tokens)
            self.ended_by = self.chat.text_of(tokens[-1]) if stopped else None
            return out
        keep, self.ended_by = cut
        update: dict[str, Any] = {
            "token_ids": tokens[:keep],
            "logprobs": list(out.logprobs)[:keep],
            "finish_reason": "stop",
        }
        if out.routed_experts is not None:
            # Routing covers every position fed, the last token never: of the kept sequence,
            # the context and all kept tokens but the last.
            update["routed_experts"] = out.routed_experts.head(fed + keep - 1)
        return out.model_copy(update=update)

    def _select_tools(self, extra_info: dict[str, Any]) -> dict[str, Any]:
        selection = extra_info.get("tool_selection")
        if selection is None:
            return dict(self.ctx.tools)
        if not isinstance(selection, list) or not all(isinstance(s, str) for s in selection):
            raise AgentLoopError(
                "extra_info.tool_selection must be a list of tool names", cause="tool_config"
            )
        unknown = [s for s in selection if s not in self.ctx.tools]
        if unknown:
            raise AgentLoopError(
                f"tool_selection names unknown tools: {unknown}", cause="tool_config"
            )
        return {name: self.ctx.tools[name] for name in selection}

    async def _release(self, data: AgentData) -> None:
        for name, instance in data.instances.items():
            try:
                await data.tools[name].release(instance)
            except Exception:  # a tool's cleanup must not lose the trajectory
                log.exception("releasing tool %s failed", name)


def _schema_of(tool: Any) -> dict[str, Any]:
    schema = tool.schema
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_none=True)
    return json.loads(json.dumps(schema))


def _create_kwargs(extra_info: dict[str, Any], tools: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """verl's per-sample `extra_info.tools_kwargs`: `{tool: {"create_kwargs": {...}}}`, each
    tool's `create_kwargs` passed to its `create` (Search-R1's ground truth for its search
    tool, DAPO's for the code interpreter). A malformed entry ends the sample with a reason
    (dead-lettered), rather than starting the tool without what the dataset gave it."""
    given = extra_info.get("tools_kwargs") or {}
    if not isinstance(given, dict):
        raise AgentLoopError("extra_info.tools_kwargs must be an object", cause="tool_config")
    out: dict[str, dict[str, Any]] = {}
    for name, entry in given.items():
        if name not in tools:
            continue  # a tool this worker does not offer the sample: nothing to create
        create = entry.get("create_kwargs", {}) if isinstance(entry, dict) else None
        if not isinstance(create, dict):
            raise AgentLoopError(
                f"extra_info.tools_kwargs.{name}.create_kwargs must be an object",
                cause="tool_config",
            )
        out[name] = create
    return out
