"""Every chat format through the real worker and broker, on a replica that answers in it.

A scripted replica (a real HTTP server of the replica contract, `agent_helpers`) plays a model
of each family: it calls the calculator in the family's syntax, then answers. The worker
recognises the parser from the model's template, stops on the family's tokens, runs the
call, and extends the trajectory with exactly what the template renders between the turns.
Also: a stop string that is no token of the tokenizer still ends the turn, and an unknown
parser name stops the worker at start in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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
from tests.integration.test_cli_first_contact import assert_one_line, rollout
from workers.agent_loop.app import AgentLoopWorker
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.agent_loop.tools import load_tools
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.llm.contract import SamplingParams
from workers.ports import free_port

pytestmark = [pytest.mark.kafka]

# Per family: the call turn the scripted model generates, the marker of a tool result in its
# context, what the template puts between the call turn and the answer (the calculator's
# answer in place of `{result}`), and the answer turn.
FORMATS = {
    "hermes": (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
        "<tool_response>",
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        "#### 5<|im_end|>",
    ),
    "llama3_json": (
        '{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eot_id|>',
        "<|start_header_id|>ipython",
        "<|start_header_id|>ipython<|end_header_id|>\n\n{result}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "#### 5<|eot_id|>",
    ),
    "mistral": (
        '[TOOL_CALLS]calculator[ARGS]{"expression": "2 + 3"}</s>',
        "[TOOL_RESULTS]",
        "[TOOL_RESULTS]{result}[/TOOL_RESULTS]",
        "#### 5</s>",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n2 + 3\n</parameter>\n"
        "</function>\n</tool_call>",
        "<tool_response>",
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n",
        "#### 5<|im_end|>",
    ),
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
        '{"expression": "2 + 3"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁output▁begin｜>",
        "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{result}"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        "#### 5<｜end▁of▁sentence｜>",
    ),
}
QUESTION = "What is 2 + 3?"
CALCULATOR = {"tools": [{"class_name": "workers.agent_loop.tools.calculator.CalculatorTool"}]}


async def _roll_out(
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    model: Path,
    script: Callable[[str], str],
    group: str,
    tool_parser: str | None = None,
) -> tuple[list, AgentLoopWorker, ScriptedReplica]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    replica = await ScriptedReplica(tokenizer, script).start()
    try:
        produce_prompts(
            kafka_config,
            topics_config.name("prompts"),
            [
                PromptEvent(
                    uid="calc",
                    prompt=[{"role": "user", "content": QUESTION}],
                    data_source="openai/gsm8k",
                    agent_name="tool_agent",
                )
            ],
        )
        cfg = AgentLoopWorkerConfig(
            group_id=group,
            model=str(model),
            n=1,
            replicas=[replica.address],
            tool_parser=tool_parser,
            sampling=SamplingParams(max_tokens=64, temperature=0.0),
        )
        worker = AgentLoopWorker(kafka_config, topics_config, cfg, tools=load_tools(CALCULATOR))
        await run_worker_until(worker, lambda: worker.counters["trajectories"] >= 1, timeout_s=90)
    finally:
        await replica.close()
    turns = read_turns(
        kafka_config, topics_config.name("turns"), until=lambda ts: bool(finals_by_sample(ts))
    )
    finals = finals_by_sample(turns)
    return trajectory(turns, "calc", 0, finals[("calc", 0)][0]), worker, replica


@pytest.mark.parametrize("family", sorted(FORMATS))
async def test_a_tool_round_in_each_format(
    family: str,
    family_model: Callable[[str], Path],
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    unique: Callable[[str], str],
) -> None:
    call, result_mark, block, answer = FORMATS[family]
    model = family_model(family)
    traj, worker, replica = await _roll_out(
        kafka_config,
        topics_config,
        model,
        lambda prompt: answer if result_mark in prompt else call,
        unique(family),
    )
    tok = AutoTokenizer.from_pretrained(model)
    assert worker.counters["dead_letters"] == 0
    assert [t.role for t in traj] == ["assistant", "tool", "assistant"]
    assert [t.loss_mask for t in traj] == [1, 0, 1]
    first, tool, last = (t.token_ids.tolist() for t in traj)
    # The model's tokens as generated; the tool block exactly the template's, tokenized alone.
    assert first == tok.encode(call, add_special_tokens=False)
    assert tool == tok.encode(block.replace("{result}", "5"), add_special_tokens=False)
    assert last == tok.encode(answer, add_special_tokens=False)
    # The parser came from the template, and the turn stopped on the family's tokens.
    stops = set(replica.requests[0]["stop_token_ids"])
    assert first[-1] in stops and tok.eos_token_id in stops
    # The whole context is the template's rendering of the conversation.
    full = tok.decode(traj[0].prompt_ids.tolist() + first + tool + last, skip_special_tokens=False)
    calculator = load_tools(CALCULATOR)["calculator"].openai_schema()
    rendered = tok.apply_chat_template(
        [
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "calculator", "arguments": {"expression": "2 + 3"}}],
            },
            {"role": "tool", "content": "5", "name": "calculator"},
            {"role": "assistant", "content": "#### 5"},
        ],
        tools=[calculator],
        tokenize=False,
    )
    assert full.rstrip("\n") == rendered.rstrip("\n")


async def test_a_stop_string_that_is_no_token_still_ends_the_turn(
    family_model: Callable[[str], Path],
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    unique: Callable[[str], str],
) -> None:
    """A Llama-3 tokenizer has no `</tool_call>` token: with the hermes parser chosen, the
    replica generates past the string, and the loop cuts the turn right after it."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    traj, _worker, replica = await _roll_out(
        kafka_config,
        topics_config,
        family_model("llama3_json"),
        lambda prompt: (
            "#### 5<|eot_id|>"
            if "ipython" in prompt.split(QUESTION)[-1]
            else call + ' and then {"more": "text"} the model should not have written<|eot_id|>'
        ),
        unique("cut"),
        tool_parser="hermes",
    )
    tok = AutoTokenizer.from_pretrained(family_model("llama3_json"))
    assert [t.role for t in traj] == ["assistant", "tool", "assistant"]
    first = traj[0].token_ids.tolist()
    assert tok.decode(first) == call
    assert len(traj[0].logprobs) == len(first) and traj[0].stop_reason == "stop"
    assert tok.decode(traj[1].token_ids.tolist(), skip_special_tokens=False) == (
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # What the replica generated past the stop string is not in the trajectory.
    assert "should not" not in tok.decode(traj[0].prompt_ids.tolist() + first)
    # No token to stop on but the model's own: every eos of its generation config.
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
    assert set(replica.requests[0]["stop_token_ids"]) == eos


def test_an_unknown_parser_stops_the_worker_at_start(
    kafka_bootstrap: str, topics_config: TopicsConfig, tiny_model: Path
) -> None:
    run = rollout(
        "--bootstrap", kafka_bootstrap,
        "--set", f"topics.prefix={topics_config.prefix}",
        "--set", "agent_loop.tool_parser=nope",
        "worker", "agent-loop",
        "--model", str(tiny_model),
        "--replica", f"http://127.0.0.1:{free_port()}",
    )  # fmt: skip
    # It exits by itself (no prompt is waited for); how soon is the machine's business.
    assert_one_line(run, 1, "unknown tool-call parser 'nope'", "hermes", bound_s=float("inf"))
