"""The LLM client's accumulation rules over resume pieces: tokens, versions, routed experts."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.routing import RoutedExperts
from workers.llm.contract import CompletionChoice
from workers.llm.progress import Progress, routing_problem

LAYERS, TOP_K, EXPERTS = 2, 2, 8


def routing(rows: list[int]) -> RoutedExperts:
    """Routing whose row i routes every layer to experts (rows[i], rows[i] + 1)."""
    r = np.asarray(rows)
    per_layer = np.stack([r, r + 1], -1)
    return RoutedExperts.from_array(np.stack([per_layer] * LAYERS, 1), EXPERTS)


def piece(tokens: list[int], rows: list[int] | None, finish: str = "abort") -> CompletionChoice:
    return CompletionChoice(
        token_ids=tokens,
        finish_reason=finish,  # type: ignore[arg-type]
        routed_experts=None if rows is None else routing(rows),
    )


def test_resumed_pieces_keep_the_first_routing_and_append_only_new_positions() -> None:
    prompt = [11, 12, 13]
    got = Progress()
    # Piece 1 at version 0: 3 tokens sampled; the prompt and the first 2 were fed: 5 rows.
    first = piece([21, 22, 23], [0, 0, 0, 0, 0])
    assert routing_problem(first, len(prompt), expected=True) is None
    got.add(first, 0, [-0.1] * 3, routed=True)
    # Piece 2 at version 1 re-feeds prompt + 3 tokens (routed anew by the new weights: 5s),
    # samples 2 more and feeds the first: 7 rows, of which positions 5 and 6 are new.
    second = piece([24, 25], [5, 5, 5, 5, 5, 5, 6], finish="length")
    assert routing_problem(second, len(prompt) + 3, expected=True) is None
    got.add(second, 1, [-0.2] * 2, routed=True)
    out = got.output("length")
    assert out.token_ids == [21, 22, 23, 24, 25] and (
        out.min_global_steps,
        out.max_global_steps,
    ) == (0, 1)
    assert out.routed_experts is not None
    assert out.routed_experts.as_array()[:, 0, 0].tolist() == [0, 0, 0, 0, 0, 5, 6]
    # One row per position fed: prompt + tokens but the last.
    assert out.routed_experts.tokens == len(prompt) + len(out.token_ids) - 1


def test_a_piece_whose_routing_does_not_cover_its_context_breaks_the_contract() -> None:
    assert routing_problem(piece([1, 2], None), 4, expected=True) == (
        "no routed_experts although they were asked for"
    )
    assert "cover 4 positions" in (routing_problem(piece([1, 2], [0] * 4), 4, expected=True) or "")
    assert routing_problem(piece([1, 2], None), 4, expected=False) is None
    with pytest.raises(ValueError, match="no routing"):
        Progress().add(piece([1], None), 0, [0.0], routed=True)


def test_without_routing_asked_nothing_is_kept() -> None:
    got = Progress()
    got.add(piece([1, 2], [0, 0, 0]), 3, [0.0, 0.0], routed=False)
    assert got.output("stop").routed_experts is None


def test_routing_of_another_model_shape_cannot_extend() -> None:
    got = Progress()
    got.add(piece([1, 2], [0, 0, 0]), 0, [0.0, 0.0], routed=True)
    other = CompletionChoice(
        token_ids=[3],
        finish_reason="stop",
        routed_experts=RoutedExperts.from_array(np.zeros((4, 3, 2), dtype=np.uint8), EXPERTS),
    )
    with pytest.raises(ValueError, match="different model shape"):
        got.add(other, 1, [0.0], routed=True)
