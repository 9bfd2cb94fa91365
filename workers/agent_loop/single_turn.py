"""`single_turn_agent`: chat template, one generation, mask all ones.

The prompt is tokenized once with the chat template (each image's token expanded as the
model's processor expands it, and the images sent with it); the response is exactly the generated
tokens, which stop on the model's end-of-turn token and every eos (`ChatFormat.stop_ids`).
The generation budget is the smaller of the sampling params' `max_tokens` and the configured
response length.
"""

from __future__ import annotations

from typing import Any

from workers.agent_loop.base import AgentLoopBase, AgentLoopOutput, TurnRecord, register
from workers.llm.contract import SamplingParams

__all__ = ["SingleTurnAgentLoop"]


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    takes_images = True

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        prompt_ids = self.apply_chat_template(sample["messages"])
        images = sample.get("images")
        extra = {}
        if images is not None:
            prompt_ids = images.expand(prompt_ids)
            extra["images"] = images.refs
        budget = min(sampling_params.max_tokens, self.ctx.max_response_length)
        stops = self.chat.stop_ids(ignore_eos=sampling_params.ignore_eos)
        params = sampling_params.model_copy(
            update={
                "max_tokens": budget,
                "stop_token_ids": sorted({*sampling_params.stop_token_ids, *stops}),
            }
        )
        out = await self.ctx.llm.generate(sample["request_id"], prompt_ids, params, **extra)
        logprobs = list(out.logprobs) if out.logprobs else [0.0] * len(out.token_ids)
        await self.ctx.on_turn(
            TurnRecord(
                role="assistant",
                token_ids=list(out.token_ids),
                logprobs=logprobs,
                min_global_steps=out.min_global_steps,
                max_global_steps=out.max_global_steps,
                stop_reason=out.finish_reason,
                prompt_ids=prompt_ids,
                routed_experts=out.routed_experts,
            )
        )
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=list(out.token_ids),
            response_mask=[1] * len(out.token_ids),
            response_logprobs=logprobs,
            num_turns=2,
            finish_reason=out.finish_reason,
            metrics={"generate_pieces": out.pieces},
            extra_fields={
                "min_global_steps": out.min_global_steps,
                "max_global_steps": out.max_global_steps,
            },
        )
