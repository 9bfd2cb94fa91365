"""The gsm8k rule: verl's semantics, numeric comparison, clipping, speed on huge inputs."""

from __future__ import annotations

import time

import pytest

from workers.reward.scorers.gsm8k import gsm8k_extract, gsm8k_score, same_number


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so #### 1,234", "1234", 1.0),
        ("#### $1,234", "1234", 1.0),
        ("#### -7", "-7", 1.0),
        ("#### -7", "7", 0.0),
        ("#### 0.50", "0.5", 1.0),
        ("#### 18.", "18", 1.0),
        ("#### 3.25", "3.25", 1.0),
        ("first #### 5 then #### 6", "6", 1.0),
        ("first #### 5 then #### 6", "5", 0.0),
        ("the answer is 42", "42", 0.0),  # strict: no '####'
        ("", "42", 0.0),
        ("####42", "42", 0.0),  # verl's regex needs the space
    ],
)
def test_strict(response: str, truth: str, expected: float) -> None:
    assert gsm8k_score(response, truth) == expected


def test_wrong_answer_gets_format_score_and_missing_gets_zero() -> None:
    assert gsm8k_score("#### 41", "42", format_score=0.1) == 0.1
    assert gsm8k_score("no answer here", "42", format_score=0.1) == 0.0
    assert gsm8k_score("#### 42", "42", score=2.0) == 2.0


def test_flexible_takes_the_last_number() -> None:
    assert gsm8k_extract("we get 12 apples, then 1,500.", "flexible") == "1500."
    assert gsm8k_score("we get 12 apples, then 1,500.", "1500", method="flexible") == 1.0
    assert gsm8k_extract("no digits . here", "flexible") is None
    assert gsm8k_score("x = -3", "-3", method="flexible") == 1.0


def test_only_the_last_300_characters_count() -> None:
    text = "#### 42 " + "x" * 400
    assert gsm8k_extract(text) is None
    assert gsm8k_extract("x" * 400 + " #### 42") == "42"


def test_100kb_response_is_fast() -> None:
    text = ("1,2,3 #### 9 " * 8000)[:100_000] + " #### 77"
    started = time.perf_counter()
    for _ in range(100):
        assert gsm8k_score(text, "77") == 1.0
    assert time.perf_counter() - started < 0.5


def test_same_number() -> None:
    assert same_number("1234", "1,234")
    assert same_number(".5", "0.50")
    assert not same_number("1.2.3", "1.23")
    assert not same_number("5", "five")
