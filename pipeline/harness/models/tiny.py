"""Build the project's own tiny causal LM and tokenizer, so nothing is ever downloaded.

`init_model(out_dir, preset, seed, reward_model)` writes a directory that loads like a hub
model with `AutoTokenizer.from_pretrained(dir)` and `AutoModelForCausalLM.from_pretrained(dir)`
(or `AutoModelForSequenceClassification` with `reward_model=True`), and that vLLM also serves:
`Qwen2ForCausalLM` (`Qwen3MoeForCausalLM` for the `moe` preset), fp32 safetensors, a
`generation_config.json` whose eos is `<|im_end|>`.

Invariants:
- The tokenizer does not depend on `seed` or `preset`: it is a byte-level BPE trained with the
  `tokenizers` library on a fixed, generated corpus (arithmetic word problems with `#### n`
  answers, chat and tool-call transcripts, digits), so token ids mean the same in every model
  this module builds. Digits are split one per token, as in Qwen2.
- `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are special tokens (ids 0, 1, 2);
  `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` are single added tokens
  that stay in decoded text (as in Qwen2.5), so a tool parser can see them.
- The weights are a pure function of (preset, seed, reward_model): the same arguments give a
  byte-identical `model.safetensors`. The global torch RNG is left as it was.
- The chat template is Qwen2/hermes style: `tools` go into the system prompt, assistant
  `tool_calls` render as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, tool
  results as `<tool_response>` blocks inside a user turn; `add_generation_prompt` appends
  `<|im_start|>assistant\\n`.
- `template` picks another chat-format family (`pipeline.harness.models.templates`:
  llama3_json, mistral, qwen3_coder, deepseek_v3): its special tokens, eos, every generation
  eos and template, and a tokenizer trained on the same corpus rendered in that format. The
  default, `hermes`, is the project's own format above, and the tokenizer of every family is
  a pure function of it.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Literal

from pipeline.harness.models.templates import FAMILIES, TemplateFamily

__all__ = [
    "CHAT_TEMPLATE",
    "HERMES",
    "PRESETS",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "build_tokenizer",
    "init_model",
    "template_family",
]

logger = logging.getLogger("rollout.llm.model_init")

Preset = Literal["tiny", "small", "moe", "vl"]

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
VOCAB_SIZE = 1024
MAX_CONTEXT = 2048
_CORPUS_SEED = 1234

# Geometry per preset. head_dim 64 everywhere: every vLLM attention backend supports it.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # Qwen3-MoE: every layer routes each token to 2 of 8 experts (`MOE_PRESETS`).
    "moe": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
}
MOE_PRESETS = frozenset({"moe"})
"""Presets built as `Qwen3MoeForCausalLM` (every layer MoE, normalised top-k weights)."""
# A tiny LLaVA around the `tiny` geometry, with its processor (`pipeline.harness.models.vl`).
PRESETS["vl"] = PRESETS["tiny"]
VL_PRESETS = frozenset({"vl"})

# A backslash at a line's end continues the line: the template's text has no line break there.
CHAT_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}\
{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\n\
You may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\n\
For each function call, return a json object with function name and arguments within\
 <tool_call></tool_call> XML tags:\\n<tool_call>\\n\
{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)\
 or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}\
{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}\
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

HERMES = TemplateFamily(
    name="hermes",
    chat_template=CHAT_TEMPLATE,
    special_tokens=SPECIAL_TOKENS,
    added_tokens=TOOL_TOKENS,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    end_of_text="<|endoftext|>",
    generation_eos=("<|im_end|>",),
    parser="hermes",
)
"""The project's own chat format (`--template hermes`, the default)."""


def template_family(name: str) -> TemplateFamily:
    """The chat-format family `name`: `hermes` or one of `templates.FAMILIES`."""
    if name == HERMES.name:
        return HERMES
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join([HERMES.name, *FAMILIES])
        raise ValueError(f"unknown chat template {name!r}; expected one of {known}") from None


# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark")
_NAMES += ("Maria", "Olivia", "Noah", "Liam", "Emma", "Sophia", "Lucas", "Mia", "Ethan", "Zoe")
_ITEMS = (
    "clips",
    "apples",
    "books",
    "marbles",
    "cookies",
    "pages",
    "eggs",
    "stickers",
    "cards",
    "pencils",
    "oranges",
    "dollars",
    "minutes",
    "tickets",
    "flowers",
    "shells",
    "candies",
)
_WORDS = (
    "the a of to and in is it that for on with as was at by this from or be are have not but "
    "what all were when we there can an your which their said if will each about how up out "
    "them then she many some so these would other into has more her two like him see time could "
    "no make than first been its who now people my made over did down only way find use may "
    "water long little very after words called just where most know get through back much "
    "before go good new write our used me man too any day same right look think also around "
    "another came come work three must because does part even place well such here take why "
    "help put different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left "
    "end along while might next sound below saw something thought both few those always show "
    "large often together asked house world going want school important until form food keep "
    "answer step total each half twice remaining price cost per week month year hour money"
).split()
_TOOLS: tuple[dict[str, Any], ...] = (
    {
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
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
)


def _word_problem(rng: random.Random) -> tuple[str, str, int]:
    """One GSM8K-like problem: (question, worked solution ending in '#### n', n)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 99), rng.randint(2, 20)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
        ans, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == 1:
        a += b
        q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        ans, work = a - b, f"{a} - {b} = {a - b}"
    elif kind == 2:
        q = f"{name} buys {b} boxes with {a} {item} in each box. How many {item} in total?"
        ans, work = a * b, f"{b} * {a} = {a * b}"
    else:
        a *= b
        q = f"{name} shares {a} {item} equally among {b} friends. How many {item} does each get?"
        ans, work = a // b, f"{a} / {b} = {a // b}"
    return q, f"{name} computes {work}.\n#### {ans}", ans


def _render(template: Any, messages: list[dict[str, Any]], tools: Any = None) -> str:
    return str(template.render(messages=messages, tools=tools, add_generation_prompt=False))


def _corpus(n_docs: int = 3000, family: TemplateFamily = HERMES) -> list[str]:
    """The tokenizer's training text, rendered in `family`'s format: a fixed function of
    `_CORPUS_SEED` and the family."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string(family.chat_template)
    rng = random.Random(_CORPUS_SEED)
    docs: list[str] = []
    for i in range(n_docs):
        q, solution, ans = _word_problem(rng)
        kind = i % 4
        if kind == 0:
            docs.append(f"Question: {q}\nAnswer: {solution}")
        elif kind == 1:
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": solution}]
            if rng.random() < 0.5:
                msgs.insert(0, {"role": "system", "content": "You are a helpful math assistant."})
            docs.append(_render(template, msgs))
        elif kind == 2:
            tool = rng.choice(_TOOLS)
            name = tool["function"]["name"]
            arg = {
                "calculator": {"expression": solution.split(" computes ")[1].split(" =")[0]},
                "search": {"query": q[:40]},
                "get_weather": {"city": rng.choice(("Paris", "Tokyo", "Lima", "Oslo"))},
            }[name]
            msgs = [
                {"role": "user", "content": q},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": name, "arguments": arg}}
                    ],
                },
                {"role": "tool", "content": json.dumps({"result": ans})},
                {"role": "assistant", "content": f"The answer is {ans}.\n#### {ans}"},
            ]
            docs.append(_render(template, msgs, tools=list(_TOOLS)))
        elif i % 8 == 3:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 30))]
            docs.append(" ".join(words).capitalize() + rng.choice((".", "?", "!", ":")))
        else:
            nums = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(12))
            docs.append(f"{nums}\n#### {rng.randint(0, 9999)}{family.end_of_text}")
    return docs


def build_tokenizer(template: str = "hermes") -> Any:
    """Train the byte-level BPE and wrap it as a `PreTrainedTokenizerFast` (not yet saved),
    with the special tokens and chat template of the family `template`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    family = template_family(template)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(family.added_tokens),
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(family=family), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added_tokens])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=family.eos,
        pad_token=family.pad,
        unk_token=None,
        bos_token=family.bos,
        model_max_length=MAX_CONTEXT,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = family.chat_template
    return fast


def _portable_tokenizer_config(path: Path) -> None:
    """Name the class `PreTrainedTokenizerFast`, which transformers 4.x (vLLM's) also knows."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def init_model(
    out_dir: str | Path,
    preset: Preset = "tiny",
    seed: int = 0,
    reward_model: bool = False,
    template: str = "hermes",
) -> Path:
    """Write a randomly initialised Qwen2 model and the project tokenizer into `out_dir`.

    Returns the directory. `reward_model=True` writes a `Qwen2ForSequenceClassification`
    with one label (a scalar score) instead of the causal LM. `template` names the chat-format
    family of the tokenizer (`template_family`).
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen3MoeConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    family = template_family(template)
    tokenizer = build_tokenizer(template)
    vocab = len(tokenizer)
    pad_id = tokenizer.convert_tokens_to_ids(family.pad)
    eos_id = tokenizer.convert_tokens_to_ids(family.eos)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos]
    moe = preset in MOE_PRESETS
    if (moe or preset in VL_PRESETS) and reward_model:
        raise ValueError(f"preset {preset!r} is a causal LM only; a reward model is tiny or small")
    config = (Qwen3MoeConfig if moe else Qwen2Config)(
        vocab_size=vocab,
        max_position_embeddings=MAX_CONTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        **PRESETS[preset],
        **({"norm_topk_prob": True, "decoder_sparse_step": 1} if moe else {}),
    )
    config.dtype = torch.float32
    if preset in VL_PRESETS:
        from pipeline.harness.models.vl import init_vl_model

        if template != "hermes":
            raise ValueError("preset 'vl' uses the hermes template only")
        return init_vl_model(out, config.to_dict(), tokenizer, seed)
    if reward_model:
        from transformers import Qwen2ForSequenceClassification as model_cls

        config.num_labels = 1
    elif moe:
        from transformers import Qwen3MoeForCausalLM as model_cls
    else:
        from transformers import Qwen2ForCausalLM as model_cls
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.eval()
    if not reward_model:
        model.generation_config = GenerationConfig(
            eos_token_id=stop_ids[0] if len(stop_ids) == 1 else stop_ids,
            pad_token_id=pad_id,
            bos_token_id=None,
            do_sample=True,
        )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out / "tokenizer_config.json")
    logger.info(
        "wrote %s model preset=%s seed=%d vocab=%d params=%d to %s",
        "reward" if reward_model else "causal-lm",
        preset,
        seed,
        vocab,
        sum(p.numel() for p in model.parameters()),
        out,
    )
    return out
