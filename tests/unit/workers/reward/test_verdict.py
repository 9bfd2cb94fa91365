"""The judge's prompt template and verdict parser (`workers.reward.verdict`), and the judge's
settings (`reward.judge`) as the config checks them at load."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.reward.config import JudgeConfig, RewardConfig
from workers.reward.exceptions import VerdictError
from workers.reward.verdict import VerdictParser, check_template, render, truth_text

DEFAULT = JudgeConfig().verdict


def test_render_fills_the_four_names_and_keeps_doubled_braces() -> None:
    template = "{{json}} Q: {prompt} | A: {response} | ref: {ground_truth} ({data_source})"
    text = render(template, prompt="1+1?", response="#### 2", ground_truth="2", data_source="m")
    assert text == "{json} Q: 1+1? | A: #### 2 | ref: 2 (m)"
    # A reference answer that is not a string is shown as JSON; braces in values stay as they are.
    assert render("{response} {ground_truth}", prompt="", response="{x}", ground_truth=["a", 1],
                  data_source="") == '{x} ["a",1]'  # fmt: skip
    assert truth_text({"target": [3]}) == '{"target":[3]}' and truth_text("3") == "3"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{response} {secret}", r"names \{secret\}; it may name only \{prompt\}"),
        ("{response.__class__}", r"names \{response.__class__\}"),
        ("{response[0]}", r"names \{response\[0\]\}"),
        ("{response!r}", "takes no format spec or conversion"),
        ("{response:>9}", "takes no format spec or conversion"),
        ("{prompt} only", "must name {response}"),
        ("{response", "write a literal brace as"),
    ],
)
def test_templates_that_could_do_more_than_substitute_are_refused(template, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_template(template)
    with pytest.raises(ValidationError, match=match):
        JudgeConfig(template=template)


def test_the_last_verdict_counts_and_numbers_are_scores() -> None:
    parser = VerdictParser(DEFAULT)
    assert parser.parse("Verdict: 0 ... on reflection, Verdict: 1") == 1.0
    assert parser.parse("Verdict:0.25") == 0.25
    assert parser.parse("Verdict: -1") == -1.0


@pytest.mark.parametrize("answer", ["", "I cannot judge this.", "Verdict: ", "verdict: 1"])
def test_an_answer_without_a_verdict_is_a_verdict_error_that_keeps_it(answer: str) -> None:
    with pytest.raises(VerdictError) as info:
        VerdictParser(DEFAULT).parse(answer)
    assert info.value.cause == "unparseable_verdict" and info.value.answer == answer[-300:]


def test_verdict_words_map_to_scores_case_insensitively() -> None:
    parser = VerdictParser(r"\[\[(\w+)\]\]", {"Correct": 1.0, "incorrect": 0.0})
    assert parser.parse("... [[CORRECT]]") == 1.0 and parser.parse("[[incorrect]]") == 0.0
    with pytest.raises(VerdictError, match="is none of"):
        parser.parse("[[maybe]]")
    with pytest.raises(VerdictError, match="is no number"):
        VerdictParser(r"Verdict: (\w+)").parse("Verdict: yes")
    with pytest.raises(VerdictError, match="not finite"):
        VerdictParser(r"Verdict: (\w+)").parse("Verdict: inf")


@pytest.mark.parametrize("pattern", ["Verdict: \\d", "(a)(b)", "(unclosed"])
def test_a_verdict_pattern_needs_one_group_and_must_compile(pattern: str) -> None:
    with pytest.raises(ValidationError, match="verdict pattern"):
        JudgeConfig(verdict=pattern)


def test_judge_settings_are_checked_at_load() -> None:
    with pytest.raises(ValidationError, match=r"judge\.enable needs judge\.model"):
        JudgeConfig(enable=True)
    with pytest.raises(ValidationError, match="must be finite"):
        JudgeConfig(verdict_scores={"yes": float("nan")})
    with pytest.raises(ValidationError, match="enable one"):
        RewardConfig(
            judge={"enable": True, "model": "/j"},
            reward_model={"enable": True, "addresses": ["http://h:1"]},
        )


def test_the_judge_is_the_scorer_after_a_custom_function() -> None:
    judged = RewardConfig(tokenizer="/p", judge={"enable": True, "model": "/j"})
    assert judged.scorer_kind == "judge" and judged.missing_for_start() is None
    assert RewardConfig(judge={"enable": True, "model": "/j"}).missing_for_start() is not None
    # A generative reward model is the judge: enabling both is no longer an error to explain.
    generative = RewardConfig(
        tokenizer="/p",
        judge={"enable": True, "model": "/j"},
        custom={"path": "builtins", "name": "len"},
    )
    assert generative.scorer_kind == "custom"
    # The judge's client waits for judge replicas that are still loading, not 30 s.
    assert JudgeConfig().llm.no_replica_wait_s == 300.0
