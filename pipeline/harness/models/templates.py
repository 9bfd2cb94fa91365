"""Chat-format families for the project's tiny model: `rollout model init --template NAME`.

A family is one model family's chat format, written by the project in that family's style:
its special tokens, the token that ends an assistant turn, every eos of its
`generation_config.json`, a chat template (tool definitions, assistant tool calls, tool
results, the generation prompt) and the tool-call parser, by vLLM's name, that reads its
calls. `hermes` is the project's own Qwen2-style format (`pipeline.harness.models.tiny`); this
module holds the others:

    llama3_json   Llama 3.1: header tokens, `<|eot_id|>`, a default system block with a
                  knowledge-cutoff date, tools in the first user message, calls as
                  `{"name": ..., "parameters": {...}}`, results in `ipython` turns
    mistral       Mistral (v11 tokenizer): `[INST]…[/INST]`, `[AVAILABLE_TOOLS]`, calls as
                  `[TOOL_CALLS]name[ARGS]{...}`, results in `[TOOL_RESULTS]…[/TOOL_RESULTS]`,
                  no generation prompt
    qwen3_coder   Qwen3-Coder: ChatML with XML calls
                  `<tool_call><function=name><parameter=p>value</parameter>…`, a default
                  system prompt whenever tools are given
    deepseek_v3   DeepSeek-V3: `<｜User｜>`/`<｜Assistant｜>`, calls between
                  `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>` with JSON arguments in a
                  fenced block, results in `<｜tool▁outputs▁begin｜>…`, after which the model
                  goes on without a new assistant marker

Invariants of every family's template (tests/unit/pipeline/harness/models/test_templates.py):
- Every special-token string it writes is one of the family's `special_tokens` or
  `added_tokens`, each a single token of the family's tokenizer.
- An assistant turn renders the same whether or not messages follow it, and a turn appended
  to a conversation only appends text (the tool results of one round are one turn): the
  rendering of a conversation is a prefix of the rendering of any continuation of it, and
  with the generation prompt, of the next assistant turn's (what lets the agent loop extend
  a trajectory's tokens without re-tokenizing them).
- Assistant `tool_calls` are read in OpenAI's shape (`{"function": {"name", "arguments"}}`,
  arguments an object or a JSON string) or flat (`{"name", "arguments"}`).

This module imports nothing heavy: the CLI reads `FAMILY_NAMES` while building its parser.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "FAMILY_NAMES", "TemplateFamily"]


@dataclass(frozen=True, slots=True)
class TemplateFamily:
    """One chat format: tokens, template and parser of a model family."""

    name: str
    chat_template: str
    special_tokens: tuple[str, ...]
    """The BPE trainer's special tokens: ids 0…k-1 in this order; skipped when decoding with
    `skip_special_tokens`."""
    added_tokens: tuple[str, ...]
    """Further single tokens that stay in decoded text (as Qwen's `<tool_call>`)."""
    eos: str
    """The tokenizer's eos: the token that closes an assistant turn."""
    pad: str
    end_of_text: str
    """Ends a plain document in the tokenizer's training corpus."""
    generation_eos: tuple[str, ...]
    """Every `eos_token_id` of `generation_config.json`, in order."""
    parser: str
    """The tool-call parser (vLLM's `--tool-call-parser` name) for the family's calls."""
    bos: str | None = None


# Lines start with `{{-` or `{%-`, so the template's own line breaks never reach its output.
_LLAMA3_JSON = r"""{{- '<|begin_of_text|>' }}
{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' + system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if not loop.first %}{{- '; ' }}{%- endif %}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
{%- if message.content is string %}{{- message.content }}
{%- else %}{{- message.content | tojson }}{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
{%- if loop.first and tools %}
{{- 'Given the following functions, respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.\n\nRespond in the format \
{"name": function name, "parameters": dictionary of argument name and its value}. \
Do not use variables.\n\n' }}
{%- for tool in tools %}{{- tool | tojson }}{{- '\n\n' }}{%- endfor %}
{%- endif %}
{{- (message.content or '') + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

_MISTRAL = r"""{{- '<s>' }}
{%- if messages and messages[0].role == 'system' %}
{{- '[SYSTEM_PROMPT]' + messages[0].content + '[/SYSTEM_PROMPT]' }}
{%- set messages = messages[1:] %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}
{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' %}
{{- message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '[TOOL_CALLS]' + tool_call.name + '[ARGS]' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{%- endfor %}
{{- '</s>' }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

_QWEN3_CODER = r"""{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system = none %}
{%- endif %}
{%- if system is not none or tools %}
{{- '<|im_start|>system\n' }}
{%- if system is not none %}{{- system }}{%- else %}
{{- 'You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.' }}
{%- endif %}
{%- if tools %}
{{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}
{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
{{- '\n<function>\n<name>' + tool.name + '</name>' }}
{%- if tool.description %}{{- '\n<description>' + tool.description + '</description>' }}
{%- endif %}
{{- '\n<parameters>' }}
{%- for pname, field in ((tool.parameters or {}).properties or {}).items() %}
{{- '\n<parameter>\n<name>' + pname + '</name>' }}
{%- if field.type is string %}{{- '\n<type>' + field.type + '</type>' }}{%- endif %}
{%- if field.description %}{{- '\n<description>' + field.description + '</description>' }}
{%- endif %}
{{- '\n</parameter>' }}
{%- endfor %}
{{- '\n</parameters>\n</function>' }}
{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with \
NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n\
value_1\n</parameter>\n</function>\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
{%- if tool_call.arguments is mapping %}
{%- for key, value in tool_call.arguments.items() %}
{{- '<parameter=' + key + '>\n' }}
{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}
{{- '\n</parameter>\n' }}
{%- endfor %}
{%- endif %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user\n' }}{%- endif %}
{{- '<tool_response>\n' + message.content + '\n</tool_response>\n' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

_DEEPSEEK_V3 = r"""{{- '<｜begin▁of▁sentence｜>' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content }}
{%- set messages = messages[1:] %}
{%- endif %}
{%- if tools %}
{{- '\n\n## Tools\nYou have access to the following tools:\n' }}
{%- for tool in tools %}
{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
{{- '\n### ' + tool.name + '\nDescription: ' + (tool.description or '') + '\n\nParameters: '
+ (tool.parameters | tojson) + '\n' }}
{%- endfor %}
{{- '\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜>\
<｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name\n```json\ntool_call_arguments\n```\
<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<｜User｜>' + message.content }}
{%- elif message.role == 'assistant' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<｜Assistant｜>' }}
{%- endif %}
{{- message.content or '' }}
{%- if message.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if not loop.first %}{{- '\n' }}{%- endif %}
{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tool_call.name + '\n```json\n' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '\n```<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<｜tool▁outputs▁begin｜>' }}{%- endif %}
{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<｜tool▁outputs▁end｜>' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and (not messages or messages[-1].role != 'tool') %}
{{- '<｜Assistant｜>' }}{%- endif %}"""


FAMILIES: dict[str, TemplateFamily] = {
    "llama3_json": TemplateFamily(
        name="llama3_json",
        chat_template=_LLAMA3_JSON,
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        added_tokens=(),
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        end_of_text="<|end_of_text|>",
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        parser="llama3_json",
        bos="<|begin_of_text|>",
    ),
    "mistral": TemplateFamily(
        name="mistral",
        chat_template=_MISTRAL,
        special_tokens=(
            "<pad>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        ),
        added_tokens=(),
        eos="</s>",
        pad="<pad>",
        end_of_text="</s>",
        generation_eos=("</s>",),
        parser="mistral",
        bos="<s>",
    ),
    "qwen3_coder": TemplateFamily(
        name="qwen3_coder",
        chat_template=_QWEN3_CODER,
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        end_of_text="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        parser="qwen3_coder",
    ),
    "deepseek_v3": TemplateFamily(
        name="deepseek_v3",
        chat_template=_DEEPSEEK_V3,
        special_tokens=(
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜▁pad▁｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
        ),
        added_tokens=(
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ),
        eos="<｜end▁of▁sentence｜>",
        pad="<｜▁pad▁｜>",
        end_of_text="<｜end▁of▁sentence｜>",
        generation_eos=("<｜end▁of▁sentence｜>",),
        parser="deepseek_v3",
        bos="<｜begin▁of▁sentence｜>",
    ),
}

FAMILY_NAMES: tuple[str, ...] = ("hermes", *FAMILIES)
"""Every `--template` name: the project's own `hermes` first."""
