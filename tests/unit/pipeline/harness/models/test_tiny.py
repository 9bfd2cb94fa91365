"""The project's tiny model: deterministic weights, a hub-like directory, the tokenizer's
contract.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.harness.models.tiny import SPECIAL_TOKENS, TOOL_TOKENS, init_model  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny-a"), preset="tiny", seed=0)


def test_same_seed_gives_byte_identical_weights(tiny: Path, tmp_path: Path) -> None:
    again = init_model(tmp_path / "again", preset="tiny", seed=0)
    other = init_model(tmp_path / "other", preset="tiny", seed=1)
    weights = (tiny / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    # The tokenizer does not depend on the seed: token ids mean the same in every model.
    assert (other / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_directory_loads_like_a_hub_model(tiny: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert cfg.max_position_embeddings == 2048
    assert 512 <= cfg.vocab_size <= 1024 and len(tok) == cfg.vocab_size
    assert next(model.parameters()).dtype == torch.float32
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == im_end
    ids = tok("What is 12 + 30? #### 42", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)


def test_special_tokens_are_single_tokens(tiny: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    ids = {t: tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS + TOOL_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == len(ids)
    # Digits split one per token, as in Qwen2; `####` survives as one piece.
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    assert "####" in tok.tokenize("so #### 7")
    # Tool tags stay in decoded text (a tool parser reads them); chat markers do not.
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    decoded = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert "<tool_call>" in decoded and "<|im_end|>" not in decoded


def test_chat_template_round_trip_with_tools(tiny: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression.",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "12+30"}},
    }
    messages = [
        {"role": "system", "content": "You solve math."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "#### 42"},
    ]
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou solve math.\n\n# Tools")
    assert '"name": "calculator"' in text.split("\n</tools>")[0]
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in text
    assert text.endswith("#### 42<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == 3  # 2 in the instructions, 1 call
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=False
    )
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_reward_model_is_a_one_label_classifier(tmp_path: Path) -> None:
    out = init_model(tmp_path / "rm", reward_model=True, seed=3)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert model.config.num_labels == 1
    with torch.inference_mode():
        score = model(input_ids=torch.tensor([[5, 6, 7, 2]])).logits
    assert score.shape == (1, 1)


def test_unknown_preset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        init_model(tmp_path, preset="huge")  # type: ignore[arg-type]


def test_moe_preset_is_a_qwen3_moe_with_every_layer_routed(tiny: Path, tmp_path: Path) -> None:
    moe = init_model(tmp_path / "moe", preset="moe", seed=0)
    config = json.loads((moe / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(moe)
    c = model.config
    assert (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.head_dim) == (4, 8, 2, 64)
    routers = [type(layer.mlp.gate).__name__ for layer in model.model.layers]
    assert routers == ["Qwen3MoeTopKRouter"] * 4  # every layer MoE
    # The project's tokenizer and template, as in every preset.
    assert (moe / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    again = init_model(tmp_path / "again", preset="moe", seed=0)
    assert (again / "model.safetensors").read_bytes() == (moe / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="causal LM only"):
        init_model(tmp_path / "rm", preset="moe", reward_model=True)
