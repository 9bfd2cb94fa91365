"""The judge's warm-start examples (`pipeline.harness.demo.judge`): labels by the gsm8k rule,
refusals."""

from __future__ import annotations

import random

from pipeline.data.arithmetic import arithmetic_rows
from pipeline.harness.demo.judge import REFUSAL, UNJUDGEABLE, judge_examples
from workers.reward.config import JudgeConfig
from workers.reward.exceptions import VerdictError
from workers.reward.scorers.gsm8k import gsm8k_score
from workers.reward.verdict import VerdictParser


def test_targets_are_the_rules_verdict_or_a_refusal_the_parser_cannot_read() -> None:
    examples = judge_examples(arithmetic_rows(400, seed=3, max_operand=3), random.Random(3))
    parser = VerdictParser(JudgeConfig().verdict)
    verdicts = []
    for ex in examples:
        truth = ex.row["reward_model"]["ground_truth"]
        if truth == UNJUDGEABLE:
            assert ex.target == REFUSAL
            try:
                parser.parse(ex.target)
            except VerdictError:
                continue
            raise AssertionError("a refusal must not parse")
        verdict = parser.parse(ex.target)
        assert verdict == gsm8k_score(ex.response, truth, method="flexible")
        verdicts.append(verdict)
    refusals = len(examples) - len(verdicts)
    assert 20 <= refusals <= 70  # about a tenth
    assert 0.3 < sum(verdicts) / len(verdicts) < 0.7  # both verdicts, in like numbers
    again = judge_examples(arithmetic_rows(400, seed=3, max_operand=3), random.Random(3))
    assert again == examples  # deterministic for a seed
