"""The reference answers a rule scorer compares against, from verl's `ground_truth` of any type.

verl keeps `reward_model.ground_truth` as the dataset wrote it: a string (gsm8k, MATH, DAPO,
geo3k), a number (hellaswag's label), or a dict of answers (Search-R1: `{"target": [...]}`).
The rule scorers compare text, so `reference_answers` turns each form into the answers it
holds: a string is itself; a number its decimal text (`4` → "4", so an integer reference
matches `#### 4`, where verl's string comparison never would); a list each of its strings or
numbers; a dict its `target` answers. The response is correct when it matches any of them.
Any other form (a bool, a dict without `target`, nested lists) is a `ScorerError` naming
the type: a custom reward function (which receives the value unchanged) is the way to score
it. Pure logic.
"""

from __future__ import annotations

from typing import Any

from workers.reward.exceptions import ScorerError

__all__ = ["reference_answers"]


def reference_answers(ground_truth: Any) -> list[str]:
    """The answers `ground_truth` holds, as text (see the module docstring)."""
    if isinstance(ground_truth, dict) and "target" in ground_truth:
        return reference_answers(ground_truth["target"])
    if isinstance(ground_truth, list) and ground_truth:
        return [_scalar(value, ground_truth) for value in ground_truth]
    return [_scalar(ground_truth, ground_truth)]


def _scalar(value: Any, whole: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ScorerError(
        f"reward_model.ground_truth {_shape(whole)} holds no answer a rule scorer compares "
        "(a string, a number, a list of them, or {'target': [...]}); a custom reward "
        "function receives it unchanged"
    )


def _shape(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"
