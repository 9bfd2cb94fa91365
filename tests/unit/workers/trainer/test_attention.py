"""The packed attention: each sequence of a packed row attends only within itself."""

from __future__ import annotations

import pytest
import torch

from workers.trainer.attention import PACKED, packed_attention, packed_attention_forward
from workers.trainer.exceptions import TrainerError


def _model() -> object:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


def test_a_packed_row_gives_each_sequence_what_it_gives_alone() -> None:
    model = _model()
    lengths = [37, 1, 21, 9]
    seqs = [torch.randint(0, 200, (n,)) for n in lengths]
    cu = torch.tensor([0, 37, 38, 59, 68], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        with packed_attention(model):
            assert model.config._attn_implementation == PACKED
            packed = model(
                input_ids=torch.cat(seqs)[None],
                position_ids=positions,
                cu_seq_lens_q=cu,
                max_length_q=37,
                use_cache=False,
            ).logits[0]
    assert model.config._attn_implementation == "sdpa"  # restored
    bounds = cu.tolist()
    diff = max(
        float((packed[lo:hi] - a).abs().max())
        for lo, hi, a in zip(bounds[:-1], bounds[1:], alone, strict=True)
    )
    assert diff < 1e-5


def test_without_boundaries_a_packed_forward_is_refused() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(TrainerError, match="cu_seq_lens_q"):
        packed_attention_forward(None, q, q, q, None)
    with pytest.raises(TrainerError, match="sliding window"):
        packed_attention_forward(
            None, q, q, q, None, sliding_window=4, cu_seq_lens_q=torch.tensor([0, 4])
        )
