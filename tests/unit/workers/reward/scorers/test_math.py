"""The math rule: answer extraction, math-verify equivalence, and the killable pool."""

from __future__ import annotations

import asyncio
import time

import pytest

from workers.reward.exceptions import ScorerError, ScorerTimeout
from workers.reward.pool import ScorerPool
from workers.reward.scorers.math import math_extract, math_score


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\sqrt{x^{2}}}", "\\sqrt{x^{2}}"),
        ("\\fbox{7}", "7"),
        ("hence \\boxed 5 and done", "5"),
        ("Answer: $0.5$.", "0.5"),
        ("Answer: .5", ".5"),
        ("answer: -3\nmore text", "-3"),
        ("no final answer", None),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("\\boxed{}", None),
    ],
)
def test_extract(response: str, answer: str | None) -> None:
    assert math_extract(response) == answer


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("Answer: 1,234", "1234", 1.0),
        ("\\boxed{-2}", "-2", 1.0),
        ("\\boxed{-2}", "2", 0.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("nothing", "1", 0.0),
    ],
)
def test_score(response: str, truth: str, expected: float) -> None:
    assert math_score(response, truth) == expected


def test_wrong_gets_format_score() -> None:
    assert math_score("\\boxed{3}", "4", format_score=0.2) == 0.2
    assert math_score("none", "4", format_score=0.2) == 0.0


def test_100kb_response() -> None:
    text = "blah \\frac{1}{3} " * 6000 + "so \\boxed{\\frac{1}{2}}"
    assert len(text) > 100_000
    started = time.perf_counter()
    assert math_score(text, "0.5") == 1.0
    assert time.perf_counter() - started < 5


async def test_pool_kills_a_hanging_checker_and_keeps_serving() -> None:
    async with ScorerPool(1) as pool:
        args = {"response": "\\boxed{9^{9^{9^{9}}}}", "ground_truth": "5"}
        started = time.monotonic()
        with pytest.raises(ScorerTimeout):
            await pool.run("math", args, timeout_s=1.5)
        assert time.monotonic() - started < 5
        assert pool.timeouts == 1
        # the replacement worker serves the next items, concurrently queued
        good = {"response": "\\boxed{\\frac{1}{2}}", "ground_truth": "0.5"}
        results = await asyncio.gather(*(pool.run("math", good, timeout_s=60) for _ in range(3)))
        assert results == [1.0, 1.0, 1.0]
        with pytest.raises(ScorerError) as err:
            await pool.run("math", {"response": "x"}, timeout_s=60)  # missing ground_truth
        assert err.value.error_class == "KeyError"
        assert await pool.run("sleep", {"seconds": 0, "echo": [1, "a"]}, timeout_s=10) == [1, "a"]
