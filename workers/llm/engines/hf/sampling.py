"""Token sampling for the `hf` engine, one batched decode step at a time.

Contract, per row of the logits:
- temperature 0 is greedy (argmax of the raw logits); the reported logprob is
  `log_softmax(logits)` at that token.
- temperature t > 0 samples from `softmax(logits / t)` restricted by `top_k` (-1: off) and
  `top_p` (1.0: off), drawing from the row's own `torch.Generator`, so a seeded request gives
  the same tokens whatever else shares its batch. The reported logprob is
  `log_softmax(logits / t)` at the sampled token: the behaviour policy's logprob before the
  top-k/top-p truncation, which is what an off-policy correction compares against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.llm.contract import SamplingParams

__all__ = ["sample_batch"]


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`scaled` logits with the tokens outside top-k / the top-p nucleus set to -inf."""
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p
        drop[0] = False
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    return scaled


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [B, V] (fp32); returns (tokens, their logprobs)."""
    temps = torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype
    )
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    greedy = torch.argmax(logits, dim=-1).tolist()
    tokens: list[int] = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            tokens.append(int(greedy[i]))
            continue
        row = scaled[i]
        if p.top_k > 0 or p.top_p < 1.0:
            row = _truncate(row, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    index = torch.tensor(tokens, dtype=torch.long)
    chosen = logprobs.gather(1, index[:, None]).squeeze(1)
    return tokens, chosen.tolist()
