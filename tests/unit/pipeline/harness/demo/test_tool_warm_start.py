"""The tool warm start's samples: token for token what the tool agent feeds the model and
expects back, masked 1 on the model's turns only, in every family."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest

from pipeline.data.arithmetic import arithmetic_rows
from pipeline.harness.demo.tool_warm_start import question_messages, tool_samples
from pipeline.harness.models.templates import FAMILY_NAMES
from workers.agent_loop.chat_format import ChatFormat
from workers.agent_loop.tools.calculator import CalculatorTool

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_samples_are_the_tool_agents_rounds(
    family: str, family_model: Callable[[str], Path]
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(family_model(family))
    chat = ChatFormat.load(tok)
    tools = [CalculatorTool().openai_schema()]
    rows = arithmetic_rows(6, seed=3, max_operand=9)
    for row, (prompt, response, mask) in zip(rows, tool_samples(tok, rows), strict=True):
        assert prompt == chat.prompt_ids(question_messages(row), tools)
        assert len(mask) == len(response)
        # Three runs: the call turn (1), the tool block (0), the answer turn (1).
        runs = [mask[0]] + [b for a, b in pairwise(mask) if a != b]
        assert runs == [1, 0, 1]
        call_len = mask.index(0)
        call, rest = response[:call_len], response[call_len:]
        block_len = mask[call_len:].index(1)
        block, answer = rest[:block_len], rest[block_len:]
        # The call turn ends on a token the loop stops on, and parses as one good call.
        assert call[-1] in chat.stop_ids(tool_calls=True)
        _, calls = chat.parser(tools).parse(tok.decode(call, skip_special_tokens=False))
        expression = row["extra_info"]["question"].removeprefix("What is ").rstrip("?")
        assert [(c.name, c.arguments, c.error) for c in calls] == [
            ("calculator", {"expression": expression}, None)
        ]
        # The block is the loop's own, with the calculator's answer; the answer turn ends the
        # trajectory on an eos.
        truth = row["reward_model"]["ground_truth"]
        result = {"role": "tool", "content": truth, "name": "calculator"}
        ended = chat.text_of(call[-1])
        assert block == chat.tool_block_ids(question_messages(row), tools, [result], ended)
        assert tok.decode(answer, skip_special_tokens=False).startswith(f"#### {truth}")
        assert answer[-1] in chat.eos_ids
