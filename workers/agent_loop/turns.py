"""Turn records of one trajectory → `TurnEvent`s on the turns topic.

The emitter holds one turn back, so that the last turn can be sent with `final=True` and the
trajectory's totals once the loop returns. Turn 0 carries the prompt ids and what the reward
stage needs (`data_source`, `reward_model`, `extra_info`, `agent_name`, the prompt's image
references). Every send is
awaited for the broker's acknowledgement in `finish()`: the worker finishes a prompt's
offset only after that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import fields
from typing import Any

from schemas.events import ExtraFields, PromptEvent, TurnEvent, trajectory_id
from schemas.media import prompt_images
from workers.agent_loop.base import AgentLoopOutput, TurnRecord
from workers.agent_loop.exceptions import AgentLoopError

__all__ = ["TurnEmitter"]

Send = Callable[[TurnEvent], Awaitable["asyncio.Future[Any]"]]
_RECORD_FIELDS = tuple(f.name for f in fields(TurnRecord))  # once, not per turn


class TurnEmitter:
    def __init__(
        self,
        send: Send,
        prompt: PromptEvent,
        sample_index: int,
        attempt_id: str,
        group_size: int,
        *,
        prompt_digest: str | None = None,
    ) -> None:
        self._send = send
        self.group_size = group_size
        self.prompt = prompt
        self.sample_index = sample_index
        self.attempt_id = attempt_id
        self.trajectory_id = trajectory_id(prompt.uid, sample_index)
        # A prompt's n samples share its digest: the worker computes it once and passes it.
        self.prompt_digest = prompt_digest or prompt.content_digest()
        self.images = prompt_images(m.content for m in prompt.prompt) or None
        self._held: TurnRecord | None = None
        self._index = 0
        self._acks: list[asyncio.Future[Any]] = []

    async def on_turn(self, record: TurnRecord) -> None:
        if self._held is not None:
            await self._emit(self._held, None)
        elif record.prompt_ids is None:
            raise AgentLoopError(
                "the first turn of a trajectory must carry prompt_ids", cause="agent_loop"
            )
        self._held = record

    async def finish(self, output: AgentLoopOutput) -> None:
        """Send the last turn as final, then wait until the broker acknowledged every turn."""
        if self._held is None:
            raise AgentLoopError("the agent loop produced no turn", cause="agent_loop")
        await self._emit(self._held, output)
        self._held = None
        await asyncio.gather(*self._acks)

    async def _emit(self, record: TurnRecord, output: AgentLoopOutput | None) -> None:
        first = self._index == 0
        prompt = self.prompt
        # Each of a TurnRecord's fields is the TurnEvent field of the same name; only turn 0
        # carries the prompt ids.
        turn = {name: getattr(record, name) for name in _RECORD_FIELDS}
        if not first:
            turn["prompt_ids"] = None
        event = TurnEvent(
            trajectory_id=self.trajectory_id,
            uid=prompt.uid,
            sample_index=self.sample_index,
            attempt_id=self.attempt_id,
            turn_index=self._index,
            **turn,
            data_source=prompt.data_source if first else None,
            reward_model=prompt.reward_model if first else None,
            extra_info=prompt.extra_info if first else None,
            agent_name=prompt.agent_name if first else None,
            group_size=self.group_size if first else None,
            prompt_digest=self.prompt_digest if first else None,
            images=self.images if first else None,
            final=output is not None,
            num_turns=output.num_turns if output is not None else None,
            response_length=len(output.response_ids) if output is not None else None,
            extra_fields=ExtraFields(**output.extra_fields) if output is not None else None,
        )
        self._index += 1
        self._acks.append(await self._send(event))
