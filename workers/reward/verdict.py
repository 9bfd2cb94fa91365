"""The judge's words: the prompt it is given, and the verdict read back from its answer. Pure.

Prompt: `reward.judge.template` is a `str.format` template over exactly these names (a literal
brace is written doubled, `{{`):

    {prompt}        the trajectory's prompt, decoded with the policy's tokenizer
    {response}      its response, decoded likewise (tool and user tokens included)
    {ground_truth}  the reference answer: a string as it is, any other JSON value as JSON
    {data_source}   the dataset it came from

A template that names anything else, or indexes, converts or formats a field, is refused when
the config loads (`check_template`), so rendering (`render`) can only substitute text.

Verdict: `VerdictParser(pattern, scores)` searches the answer with the regular expression
`pattern`, which has exactly one capture group, and takes the *last* match (a judge that
reasons first states its verdict at the end). With `scores` (captured text → score, compared
after stripping and lower-casing) the captured text must be one of its keys; without, the
captured text must be a finite number, which is the score. Anything else is a `VerdictError`
that carries the answer: the stage gives the trajectory the judge's failure score, tagged,
and counts it.
"""

from __future__ import annotations

import math
import re
import string
from typing import Any

import orjson

from workers.reward.exceptions import VerdictError

__all__ = ["FIELDS", "VerdictParser", "check_pattern", "check_template", "render", "truth_text"]

FIELDS = ("prompt", "response", "ground_truth", "data_source")

#: How much of an unparseable answer its error (and the trajectory's tag) keeps.
ANSWER_CHARS = 300


def check_template(template: str) -> None:
    """ValueError unless `template` names only `FIELDS`, plainly, and names `{response}`."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"template: {exc} (write a literal brace as {{{{ or }}}})") from exc
    named: set[str] = set()
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in FIELDS:
            allowed = ", ".join(f"{{{field}}}" for field in FIELDS)
            raise ValueError(f"template names {{{name}}}; it may name only {allowed}")
        if spec or conversion:
            raise ValueError(f"template: {{{name}}} takes no format spec or conversion")
        named.add(name)
    if "response" not in named:
        raise ValueError("template must name {response}: the judge has to see the answer")


def render(
    template: str, *, prompt: str, response: str, ground_truth: Any, data_source: str
) -> str:
    """The judge's prompt text (`template` checked by `check_template`)."""
    return template.format(
        prompt=prompt,
        response=response,
        ground_truth=truth_text(ground_truth),
        data_source=data_source,
    )


def truth_text(value: Any) -> str:
    """A reference answer as the judge reads it: a string as it is, else its JSON."""
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def check_pattern(pattern: str) -> re.Pattern[str]:
    """The compiled verdict pattern; ValueError unless it compiles with one capture group."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"verdict pattern {pattern!r} does not compile: {exc}") from exc
    if compiled.groups != 1:
        raise ValueError(
            f"verdict pattern {pattern!r} has {compiled.groups} capture groups; it needs exactly "
            "one, around the verdict (use (?:...) for the others)"
        )
    return compiled


class VerdictParser:
    """Reads the score out of a judge's answer (module docstring)."""

    def __init__(self, pattern: str, scores: dict[str, float] | None = None) -> None:
        self.pattern = check_pattern(pattern)
        self.scores = {key.strip().lower(): float(value) for key, value in (scores or {}).items()}

    def parse(self, answer: str) -> float:
        """The score `answer` states; `VerdictError` when it states none this parser reads."""
        found = self.pattern.findall(answer)
        if not found:
            raise self._error(answer, f"no match for {self.pattern.pattern!r}")
        said = str(found[-1]).strip()
        if self.scores:
            score = self.scores.get(said.lower())
            if score is None:
                raise self._error(answer, f"verdict {said!r} is none of {sorted(self.scores)}")
            return score
        try:
            score = float(said)
        except ValueError:
            raise self._error(answer, f"verdict {said!r} is no number") from None
        if not math.isfinite(score):
            raise self._error(answer, f"verdict {said!r} is not finite")
        return score

    @staticmethod
    def _error(answer: str, why: str) -> VerdictError:
        clipped = answer[-ANSWER_CHARS:]
        return VerdictError(f"unparseable verdict ({why}) in {clipped!r}", answer=clipped)
