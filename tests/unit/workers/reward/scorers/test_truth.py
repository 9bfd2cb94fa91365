"""verl's ground truths of any type, as the rule scorers compare them."""

from __future__ import annotations

import pytest

from workers.reward.exceptions import ScorerError
from workers.reward.scorers.gsm8k import gsm8k_score
from workers.reward.scorers.math import math_score
from workers.reward.scorers.truth import reference_answers


@pytest.mark.parametrize(
    ("truth", "answers"),
    [
        ("72", ["72"]),
        (72, ["72"]),
        (2.5, ["2.5"]),
        (["4", 4], ["4", "4"]),
        ({"target": ["Shakespeare", "W. S."]}, ["Shakespeare", "W. S."]),
        ({"target": "Paris"}, ["Paris"]),
    ],
)
def test_each_form_holds_its_answers(truth: object, answers: list[str]) -> None:
    assert reference_answers(truth) == answers


@pytest.mark.parametrize("truth", [True, {"answer": "x"}, [["a"]], [], None])
def test_other_forms_are_a_scorer_error_naming_the_type(truth: object) -> None:
    with pytest.raises(ScorerError, match="custom reward function receives it unchanged"):
        reference_answers(truth)


def test_an_integer_reference_scores_a_gsm8k_answer() -> None:
    assert gsm8k_score("so #### 4", reference_answers(4)) == 1.0
    assert gsm8k_score("so #### 5", reference_answers(4)) == 0.0
    assert gsm8k_score("so #### 5", reference_answers([4, "5"])) == 1.0


def test_any_reference_of_a_list_scores_a_math_answer() -> None:
    assert math_score("\\boxed{3}", reference_answers([2, 3])) == 1.0
    assert math_score("\\boxed{1}", reference_answers({"target": ["2", "3"]})) == 0.0
