"""The model's chat format: stop tokens from the tokenizer and its files, and tool blocks that
extend a trajectory exactly as the template renders the conversation, for every family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.harness.models.tiny import template_family
from workers.agent_loop.chat_format import ChatFormat
from workers.agent_loop.exceptions import AgentLoopError
from workers.agent_loop.parsers import HermesToolParser

transformers = pytest.importorskip("transformers")

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = {
    "type": "function",
    "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}},
}
RESULT = {"role": "tool", "content": "5", "name": "calculator"}

# Per family: the model's call turn as it generates it (up to the token it stops on), and what
# the template puts between that turn and the next generation prompt. Written out by hand.
TURNS = {
    "hermes": (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "llama3_json": (
        '{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eot_id|>',
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "mistral": (
        '[TOOL_CALLS]calculator[ARGS]{"expression": "2 + 3"}</s>',
        "[TOOL_RESULTS]5[/TOOL_RESULTS]",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n2 + 3\n</parameter>\n"
        "</function>\n</tool_call>",
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
        '{"expression": "2 + 3"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>5"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
    ),
}
# The default system prompt each family's template injects when given tools.
DEFAULT_SYSTEM = {
    "hermes": "You are a helpful assistant.",
    "llama3_json": "Cutting Knowledge Date",
    "mistral": "[AVAILABLE_TOOLS]",
    "qwen3_coder": "You are Qwen",
    "deepseek_v3": "## Tools",
}

# Qwen2.5-Instruct's way: a default system prompt whenever the first message is no system one.
QWEN25_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(family_model: Callable[[str], Path]) -> Callable[[str], Any]:
    loaded: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in loaded:
            loaded[family] = transformers.AutoTokenizer.from_pretrained(family_model(family))
        return loaded[family]

    return get


def ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", sorted(TURNS))
def test_stop_tokens_come_from_the_tokenizer_its_files_and_the_template(
    family: str, tokenizer: Callable[[str], Any]
) -> None:
    tok = tokenizer(family)
    spec = template_family(family)
    chat = ChatFormat.load(tok)
    assert chat.parser.name == spec.parser  # recognised from the template
    eos = {tok.convert_tokens_to_ids(t) for t in spec.generation_eos}
    assert chat.eos_ids == eos | {tok.eos_token_id}
    assert chat.end_of_turn_id == tok.convert_tokens_to_ids(spec.eos)
    parser_stops = {i for s in chat.parser.stop_strings for i in ids(tok, s)}
    assert chat.stop_strings == ()  # every family's stop strings are tokens of its own
    assert chat.stop_ids(tool_calls=True) == sorted(eos | {chat.end_of_turn_id} | parser_stops)
    assert chat.stop_ids() == sorted(eos | {chat.end_of_turn_id})
    assert chat.stop_ids(ignore_eos=True, tool_calls=True) == sorted(parser_stops)


@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("family", sorted(TURNS))
def test_the_context_after_a_tool_round_is_the_templates_rendering(
    family: str, system: bool, tokenizer: Callable[[str], Any]
) -> None:
    tok = tokenizer(family)
    chat = ChatFormat.load(tok)
    messages = [{"role": "system", "content": "You solve math."}] * system + QUESTION
    generated_text, expected_block = TURNS[family]
    prompt = chat.prompt_ids(messages, [CALCULATOR])
    generated = ids(tok, generated_text)
    ended_by = chat.text_of(generated[-1])
    block = chat.tool_block_ids(messages, [CALCULATOR], [RESULT], ended_by)
    # Appended, never re-tokenized: exactly the hand-written block's tokens.
    assert block == ids(tok, expected_block)
    context = prompt + generated + block
    # ...and the whole context is what the template renders for the conversation.
    conversation = [*messages, {"role": "assistant", "content": "", "tool_calls": [CALL]}, RESULT]
    rendered = chat.render(conversation, [CALCULATOR], gen=True)
    assert tok.decode(context, skip_special_tokens=False) == rendered
    # The default system prompt (injected without a system message) is in the prompt, once.
    text = tok.decode(context, skip_special_tokens=False)
    assert text.count(DEFAULT_SYSTEM[family]) == (
        0 if system and family in ("hermes", "qwen3_coder") else 1
    )
    assert DEFAULT_SYSTEM[family] not in tok.decode(block, skip_special_tokens=False)
    # The calls in the generated turn are found by the format's parser.
    _, calls = chat.parser([CALCULATOR]).parse(tok.decode(generated, skip_special_tokens=False))
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2 + 3"})]


def test_a_turn_that_ended_on_its_end_of_turn_token_is_not_closed_twice(
    tokenizer: Callable[[str], Any],
) -> None:
    tok = tokenizer("hermes")
    chat = ChatFormat.load(tok)
    generated_text, expected_block = TURNS["hermes"]
    # Not stopped on `</tool_call>` (a stop token the replica ignored): the model closed its
    # turn itself; the newline after the end of turn is all that is left of it.
    generated = ids(tok, generated_text + "<|im_end|>")
    block = chat.tool_block_ids(QUESTION, [CALCULATOR], [RESULT], chat.text_of(generated[-1]))
    assert block == ids(tok, expected_block.removeprefix("<|im_end|>"))
    # Two results in one round share one user turn, in the calls' order.
    six = {"role": "tool", "content": "6", "name": "calculator"}
    block = chat.tool_block_ids(QUESTION, [CALCULATOR], [RESULT, six], None)
    assert tok.decode(block, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_injects_a_default_system_prompt(
    tokenizer: Callable[[str], Any],
) -> None:
    tok = tokenizer("hermes")
    chat = ChatFormat(tok, HermesToolParser)
    tok_template, tok.chat_template = tok.chat_template, QWEN25_TEMPLATE
    try:
        # Rendering the tool messages alone, as the loop once did, injects the system prompt
        # into the middle of the trajectory...
        alone = tok.apply_chat_template([RESULT], add_generation_prompt=True, tokenize=False)
        assert "You are Qwen" in alone
        # ...rendering them after the turn does not.
        block = chat.tool_block_ids(QUESTION, None, [RESULT], "<|im_end|>")
        assert tok.decode(block, skip_special_tokens=False) == (
            "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        prompt = chat.prompt_ids(QUESTION)
        assert tok.decode(prompt, skip_special_tokens=False).count("You are Qwen") == 1
    finally:
        tok.chat_template = tok_template


def test_chat_template_kwargs_reach_every_rendering(tokenizer: Callable[[str], Any]) -> None:
    tok = tokenizer("hermes")
    template = tok.chat_template.replace(
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and not enable_thinking %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
    )
    assert template != tok.chat_template
    saved, tok.chat_template = tok.chat_template, template
    try:
        plain = ChatFormat(tok, HermesToolParser)
        quiet = ChatFormat(tok, HermesToolParser, {"enable_thinking": False})
        think = "<think>\n\n</think>\n\n"
        for chat, expected in ((plain, False), (quiet, True)):
            prompt = tok.decode(chat.prompt_ids(QUESTION), skip_special_tokens=False)
            block = chat.tool_block_ids(QUESTION, None, [RESULT], None)
            assert prompt.endswith(think) is expected
            assert tok.decode(block, skip_special_tokens=False).endswith(think) is expected
    finally:
        tok.chat_template = saved


def test_a_stop_string_that_is_no_token_cuts_the_turn(tokenizer: Callable[[str], Any]) -> None:
    tok = tokenizer("llama3_json")  # has no `</tool_call>` token
    chat = ChatFormat(tok, HermesToolParser)
    assert chat.stop_strings == ("</tool_call>",)
    assert chat.stop_ids(tool_calls=True) == sorted(chat.eos_ids)
    generated = ids(tok, '<tool_call>{"name": "f", "arguments": {}}</tool_call> and more text')
    keep, stop = chat.cut(generated) or (0, "")
    assert stop == "</tool_call>"
    assert tok.decode(generated[:keep]).endswith("</tool_call>")
    assert "</tool_call>" not in tok.decode(generated[: keep - 1])
    assert chat.cut(ids(tok, "no call here")) is None
    # With the token (the hermes tokenizer's), nothing is cut: the replica stops on it.
    hermes = ChatFormat(tokenizer("hermes"), HermesToolParser)
    assert hermes.stop_strings == () and hermes.cut(generated) is None


def test_a_template_that_rewrites_a_turn_once_tools_follow_is_refused(
    tokenizer: Callable[[str], Any],
) -> None:
    tok = tokenizer("hermes")
    saved = tok.chat_template
    tok.chat_template = (
        "{%- for m in messages %}{{- m.role + ': ' + m.content }}"
        "{%- if m.role == 'assistant' and loop.last %}{{- '<|im_end|>' }}"
        "{%- elif m.role == 'assistant' %}{{- ' (called)' }}{%- endif %}{%- endfor %}"
    )
    try:
        chat = ChatFormat(tok, HermesToolParser)
        with pytest.raises(AgentLoopError, match="differently once tool results follow") as e:
            chat.tool_block_ids(QUESTION, None, [RESULT], None)
        assert e.value.cause == "chat_template"
    finally:
        tok.chat_template = saved
