"""The gsm8k rule, after verl's `gsm8k.compute_score`.

- Only the last 300 characters of the response are searched (verl's clip; also bounds the
  regex cost, so a 100 KB response scores in microseconds and runs inline).
- strict: the last `#### <number>` (a `$` right after `#### ` is allowed); flexible: the
  last number anywhere in the clipped text. Commas and `$` are stripped.
- Correct → `score` (1.0), a present but wrong answer → `format_score` (0.0 by default),
  no answer → 0.0.

One deliberate difference from verl: answers are compared as numbers when both sides are
numbers (`1,234` = `1234`, `0.50` = `0.5`, `18.` = `18`), where verl compares strings.
Every answer verl counts correct is still correct here.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Literal

__all__ = ["CLIP_CHARS", "gsm8k_extract", "gsm8k_score", "same_number"]

CLIP_CHARS = 300
_STRICT = re.compile(r"#### \$?(-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")
_INVALID = {"", ".", ",", "-"}


def gsm8k_extract(response: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer as a string without commas or `$`, or None when there is none."""
    tail = response[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        if not found:
            return None
        return _clean(found[-1])
    if method != "flexible":
        raise ValueError(f"unknown gsm8k method {method!r}")
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        cleaned = _clean(candidate)
        if cleaned.strip(".-") and cleaned not in _INVALID:
            return cleaned
    return None


def _clean(answer: str) -> str:
    return answer.replace(",", "").replace("$", "")


def same_number(answer: str, truth: str) -> bool:
    """Equal as strings, or as decimal numbers when both parse (`0.50` == `.5`)."""
    truth = _clean(truth.strip())
    if answer == truth:
        return True
    try:
        return Decimal(answer.rstrip(".")) == Decimal(truth.rstrip("."))
    except InvalidOperation:
        return False


def gsm8k_score(
    response: str,
    ground_truth: str | list[str],
    *,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's gsm8k reward: `score` if correct, `format_score` if wrong, 0.0 if absent.
    `ground_truth` may be several answers (`truth.reference_answers`): any one is correct."""
    answer = gsm8k_extract(response, method)
    if answer is None:
        return 0.0
    truths = [ground_truth] if isinstance(ground_truth, str) else ground_truth
    return score if any(same_number(answer, t) for t in truths) else format_score
