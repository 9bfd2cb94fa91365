"""The chat-format families of `rollout model init --template`: tokens, eos, prefix-stable
templates, and the project's special-token strings only where a family defines them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.cli.main import main
from pipeline.harness.models.templates import FAMILIES, FAMILY_NAMES
from pipeline.harness.models.tiny import HERMES, template_family

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[4]
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CONVERSATION = [
    {"role": "system", "content": "You solve math."},
    {"role": "user", "content": "What is 2 + 3 and 4 * 5?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
            for e in ("2 + 3", "4 * 5")
        ],
    },
    {"role": "tool", "content": "5", "name": "calculator"},
    {"role": "tool", "content": "20", "name": "calculator"},
    {"role": "assistant", "content": "#### 5 and 20"},
]
# A special-token string of some family: `<|...|>`, `<｜...｜>`, `[UPPER]`, `</s>`.
SPECIAL = re.compile(r"<\|[a-z_]+\|>|<｜[^｜]+｜>|\[/?[A-Z_]+\]|</?s>|<pad>")


def test_family_names() -> None:
    assert FAMILY_NAMES == ("hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3")
    assert template_family("hermes") is HERMES
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        template_family("nope")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_familys_tokens_and_files(family: str, family_model: Callable[[str], Path]) -> None:
    spec = template_family(family)
    model = family_model(family)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    for token in (*spec.special_tokens, *spec.added_tokens):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    # Special tokens are ids 0..k-1, in order; the vocabulary stays within the model's.
    assert [tok.convert_tokens_to_ids(t) for t in spec.special_tokens] == list(
        range(len(spec.special_tokens))
    )
    assert len(tok) == json.loads((model / "config.json").read_text())["vocab_size"]
    assert tok.eos_token == spec.eos and tok.pad_token == spec.pad
    assert tok.chat_template == spec.chat_template
    generation = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    expected = [tok.convert_tokens_to_ids(t) for t in spec.generation_eos]
    assert generation == (expected[0] if len(expected) == 1 else expected)
    # Another family's special tokens are no tokens here: text, several tokens each.
    own = {*spec.special_tokens, *spec.added_tokens}
    others = {t for f in FAMILY_NAMES for t in template_family(f).special_tokens} - own
    assert all(len(tok.encode(t, add_special_tokens=False)) > 1 for t in others)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_template_writes_only_its_own_special_tokens(family: str) -> None:
    spec = template_family(family)
    written = set(SPECIAL.findall(spec.chat_template))
    assert written, "the pattern finds the family's tokens"
    assert written <= {*spec.special_tokens, *spec.added_tokens}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_conversation_renders_as_a_prefix_of_its_continuations(
    family: str, family_model: Callable[[str], Path]
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(family_model(family))

    def render(messages: list[dict], gen: bool = False) -> str:
        return str(
            tok.apply_chat_template(
                messages, tools=[CALC], add_generation_prompt=gen, tokenize=False
            )
        )

    full = render(CONVERSATION)
    for k in (2, 3, 5):  # after the question, the call turn, the round's two results
        assert full.startswith(render(CONVERSATION[:k])), k
    # After the user's question and after the tool results, the generation prompt is the
    # start of the next assistant turn.
    for k in (2, 5):
        assert full.startswith(render(CONVERSATION[:k], gen=True)), k
    for tool_call in ("2 + 3", "4 * 5"):
        assert tool_call in full
    assert "5" in full and "20" in full and "#### 5 and 20" in full


def test_rollout_model_init_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "init", "--out", str(tmp_path / "m"), "--template", "mistral"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.chat_template == FAMILIES["mistral"].chat_template and tok.eos_token == "</s>"


# Where the family's special-token strings may be written: the templates' definitions, the
# parsers that read those formats, and tests.
ALLOWED = (
    "pipeline/harness/models/tiny.py",
    "pipeline/harness/models/templates.py",
    "workers/agent_loop/parsers/",
)


def test_special_token_strings_are_written_only_where_their_format_is_defined() -> None:
    tokens = {t for f in FAMILY_NAMES for t in template_family(f).special_tokens}
    tokens |= {t for f in FAMILY_NAMES for t in template_family(f).added_tokens}
    found = []
    for package in ("schemas", "workers", "pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            text = path.read_text()
            found += [
                f"{where}: {t}"
                for t in sorted(tokens)
                if t in text and not where.startswith(ALLOWED)
            ]
    assert not found, "\n".join(found)
