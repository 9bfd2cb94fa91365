"""The tool loop, made deterministic by a scripted replica, through the real worker and broker."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from schemas import PromptEvent
from tests.integration.agent_helpers import (
    ScriptedReplica,
    finals_by_sample,
    produce_prompts,
    read_turns,
    run_worker_until,
    trajectory,
)
from workers.agent_loop.app import AgentLoopWorker
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.agent_loop.tools import load_tools
from workers.llm.contract import SamplingParams

pytestmark = [pytest.mark.kafka]

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def script(prompt_text: str) -> str:
    """Call a tool on the first turn (which one depends on the question), then answer."""
    if "<tool_response>" in prompt_text:
        answer = prompt_text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        return f"The tool said {answer}.\n#### {answer}<|im_end|>"
    if "broken" in prompt_text:
        return '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>'
    if "unknown" in prompt_text:
        return CALL.format(name="weather", args='{"city": "Paris"}')
    return CALL.format(name="calculator", args='{"expression": "2 + 3 * 4"}')


@pytest.fixture
async def scripted(tiny_model):
    replica = await ScriptedReplica(AutoTokenizer.from_pretrained(tiny_model), script).start()
    yield replica
    await replica.close()


async def test_tool_loop_masks_tool_tokens_and_round_trips(
    kafka_config, topics_config, tiny_model, scripted, unique
) -> None:
    prompts = [
        PromptEvent(
            uid="calc",
            prompt=[{"role": "user", "content": "What is 2 + 3 * 4?"}],
            data_source="openai/gsm8k",
            agent_name="tool_agent",
        ),
        PromptEvent(
            uid="unknown",
            prompt=[{"role": "user", "content": "Call an unknown tool."}],
            data_source="openai/gsm8k",
            agent_name="tool_agent",
        ),
        PromptEvent(
            uid="broken",
            prompt=[{"role": "user", "content": "Make a broken call."}],
            data_source="openai/gsm8k",
            agent_name="tool_agent",
        ),
        PromptEvent(
            uid="none",
            prompt=[{"role": "user", "content": "No tools for you."}],
            data_source="openai/gsm8k",
            agent_name="tool_agent",
            extra_info={"tool_selection": []},
        ),
    ]
    produce_prompts(kafka_config, topics_config.name("prompts"), prompts)
    tools = load_tools(
        {"tools": [{"class_name": "workers.agent_loop.tools.calculator.CalculatorTool"}]}
    )
    cfg = AgentLoopWorkerConfig(
        group_id=unique("tool"),
        model=str(tiny_model),
        n=1,
        replicas=[scripted.address],
        sampling=SamplingParams(max_tokens=64, temperature=0.0),
    )
    worker = AgentLoopWorker(kafka_config, topics_config, cfg, tools=tools)
    await run_worker_until(
        worker, lambda: worker.counters["trajectories"] >= len(prompts), timeout_s=60
    )
    turns = read_turns(
        kafka_config, topics_config.name("turns"), until=lambda ts: len(finals_by_sample(ts)) >= 4
    )
    finals = finals_by_sample(turns)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    end_call = tokenizer.convert_tokens_to_ids("</tool_call>")

    def texts(uid: str) -> tuple[list, str, str]:
        traj = trajectory(turns, uid, 0, finals[(uid, 0)][0])
        response = np.concatenate([t.token_ids for t in traj]).tolist()
        mask = [t.loss_mask for t in traj for _ in t.token_ids]
        full = tokenizer.decode(traj[0].prompt_ids.tolist() + response, skip_special_tokens=False)
        tool_text = tokenizer.decode(
            [tok for tok, m in zip(response, mask, strict=True) if m == 0],
            skip_special_tokens=False,
        )
        return traj, full, tool_text

    traj, full, tool_text = texts("calc")
    assert [t.role for t in traj] == ["assistant", "tool", "assistant"]
    assert traj[0].token_ids[-1] == end_call  # stopped on the parser's stop token
    assert traj[-1].final and traj[-1].num_turns == 4 and traj[-1].token_ids[-1] == im_end
    assert "<tool_response>\n14\n</tool_response>" in tool_text  # the calculator ran: 2 + 3*4
    assert "#### 14" in full
    # prompt + response decodes to the conversation the chat template would render
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is 2 + 3 * 4?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "calculator", "arguments": {"expression": "2 + 3 * 4"}}],
            },
            {"role": "tool", "content": "14"},
            {"role": "assistant", "content": "The tool said 14.\n#### 14"},
        ],
        tools=[tools["calculator"].openai_schema()],
        tokenize=False,
    )
    assert full.strip() == rendered.strip()
    assert traj[1].logprobs is None and traj[0].logprobs is not None
    assert all(t.min_global_steps == 0 for t in traj)

    _traj, _full, tool_text = texts("unknown")
    assert "Error: unknown tool 'weather'" in tool_text
    _traj, _full, tool_text = texts("broken")
    assert "Error:" in tool_text
    traj, full, _ = texts("none")
    assert "<tools>" not in full  # tool_selection [] offers no tools
