"""Where the padded and the packed layouts meet: one function turns a micro-batch of the wire's
padded layout (`workers.trainer.batching`) into what one forward is fed, and maps what that
forward computes back to the padded [B, R] response tensors the loss reads. The loss code never
knows which layout (or which attention kernel, `workers.trainer.attention`) ran.

- packed (`Layout.packed`): the micro-batch's real tokens, sequence after sequence in batch
  order, in one row (1, T) without padding; position ids restart at 0 for each sequence;
  `cu_seqlens` (int32, [n + 1]) bounds them for the attention.
- padded (the reference the packed layout is tested against): `input_ids`, `attention_mask`
  and `position_ids` of the micro-batch as they are, (B, P + R).

Either way `predict` indexes, in the forward's flattened token axis, the position whose
output predicts each *selected* response token (response column j of sample i is predicted by
the token before it), `targets` are those tokens, and `scatter` puts one value per selected
token back at (i, j) of a zero [B, R] tensor. Selected are the real response tokens, or with
`trained_only` those with `response_mask` 1 (the only ones the loss reads: tool tokens and
padding cost no LM-head work then, and hold 0). `take` maps any per-column tensor of the padded
layout, (B, P + R, ...), to the forward's layout (the routed experts of R3, the response
positions whose routing is counted), so per-token side data is packed exactly as the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workers.trainer.batching import TrajectoryBatch

__all__ = ["Layout", "layout"]


@dataclass(frozen=True)
class Layout:
    """One forward's view of a micro-batch (module docstring)."""

    packed: bool
    input_ids: torch.Tensor  # (1, T) packed, (B, P + R) padded
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # padded only
    cu_seqlens: torch.Tensor | None  # packed only: int32 [n + 1]
    max_length: int  # the longest sequence
    rows: torch.Tensor | None  # packed only: each token's (row, column) in the padded layout
    cols: torch.Tensor | None
    predict: torch.Tensor  # (N,) into the flattened token axis of `input_ids`
    targets: torch.Tensor  # (N,) the selected response tokens
    out_rows: torch.Tensor  # (N,) where each goes in [B, R]
    out_cols: torch.Tensor
    shape: tuple[int, int]  # (B, R)

    @property
    def tokens(self) -> int:
        """Tokens the forward computes (padding included for the padded layout)."""
        return int(self.input_ids.numel())

    def take(self, padded: torch.Tensor) -> torch.Tensor:
        """A (B, P + R, ...) tensor of the padded layout in this forward's layout."""
        if not self.packed:
            return padded
        assert self.rows is not None and self.cols is not None
        rows, cols = self.rows.to(padded.device), self.cols.to(padded.device)
        return padded[rows, cols].unsqueeze(0)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """One value per selected token → [B, R], 0 where nothing was selected (differentiable)."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.out_rows, self.out_cols), values)

    def forward_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the model's forward for this layout."""
        if not self.packed:
            return {"attention_mask": self.attention_mask, "position_ids": self.position_ids}
        return {
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "max_length_q": self.max_length,
        }


def layout(batch: TrajectoryBatch, *, packed: bool = True, trained_only: bool = False) -> Layout:
    """The forward's view of the micro-batch `batch` (module docstring)."""
    input_ids = batch["input_ids"]
    attention = batch["attention_mask"].bool()
    device = input_ids.device
    b, width = input_ids.shape
    p = batch.prompt_length
    responses = batch["responses"]
    r = responses.shape[1]
    selected = attention[:, p:] if not trained_only else batch["response_mask"] > 0
    selected = selected & attention[:, p:]
    out_rows, out_cols = selected.nonzero(as_tuple=True)  # row-major: sample by sample
    targets = responses[out_rows, out_cols]
    lengths = attention.sum(dim=1)
    if not packed:
        predict = out_rows * width + (p - 1) + out_cols
        return Layout(
            packed=False,
            input_ids=input_ids,
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
            cu_seqlens=None,
            max_length=int(lengths.max()),
            rows=None,
            cols=None,
            predict=predict,
            targets=targets,
            out_rows=out_rows,
            out_cols=out_cols,
            shape=(b, r),
        )
    rows, cols = attention.nonzero(as_tuple=True)  # each sequence's tokens, in order
    starts = torch.zeros(b + 1, dtype=torch.long, device=device)
    starts[1:] = lengths.cumsum(0)
    first = _first_column(attention)  # each row's left padding
    position_ids = cols - first[rows]
    # response column j of row i is column p + j; its predictor is column p + j - 1, which
    # sits at starts[i] + (p + j - 1 - first[i]) in the packed row
    predict = starts[out_rows] + (p - 1 + out_cols - first[out_rows])
    return Layout(
        packed=True,
        input_ids=input_ids[rows, cols].unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        attention_mask=None,
        cu_seqlens=starts.to(torch.int32),
        max_length=int(lengths.max()),
        rows=rows,
        cols=cols,
        predict=predict,
        targets=targets,
        out_rows=out_rows,
        out_cols=out_cols,
        shape=(b, r),
    )


def _first_column(attention: torch.Tensor) -> torch.Tensor:
    """Each row's first real column (prompts are left-padded: a sequence is one run of ones)."""
    return (attention.long().cumsum(dim=1) == 0).sum(dim=1)
