"""The math rule: the final answer of a response, checked for equivalence by math-verify.

- Final answer: the content of the last `\\boxed{...}` (or `\\fbox{...}`, braces balanced,
  also `\\boxed 5`); else what follows the last `Answer:` on its line (surrounding `$` and a
  trailing period removed); else there is none.
- Equivalence: `math_verify.verify(parse(gold), parse(answer))`, both wrapped in `\\boxed{}`
  so math-verify's boxed extraction reads them whole (`\\frac{1}{2}` = `0.5`, `x^2+1` =
  `1+x^2`).
- Correct → `score` (1.0), present but not equivalent → `format_score` (0.0), none → 0.0.

math-verify runs sympy, and some expressions (`9^{9^{9^{9}}}`) make it compute forever in C
code that no signal interrupts. So `math_score` has no timeout of its own (math-verify's
signal-based ones are disabled): the reward stage runs it only through the scorer pool
(`workers.reward.pool`), which kills a worker process that exceeds the per-item timeout.
"""

from __future__ import annotations

import logging
import re

__all__ = ["math_extract", "math_score", "math_verify_equal"]

log = logging.getLogger("rollout.reward.math")

_ANSWER = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    command = next(c for c in _BOX_COMMANDS if rest.startswith(c))
    rest = rest[len(command) :]
    if rest.startswith(" "):
        # `\boxed 5`: the argument is the next token.
        token = rest[1:].split("$", 1)[0].split()
        return token[0] if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: no answer


def math_extract(response: str) -> str | None:
    """The final answer of a response, or None when it gives none."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed.strip() or None
    matches = _ANSWER.findall(response[-4096:])
    if not matches:
        return None
    answer = matches[-1].rstrip(" .").strip(" $").rstrip(" .")
    return answer or None


def math_verify_equal(gold: str, answer: str) -> bool:
    """Whether math-verify finds `answer` equivalent to `gold` (no timeout: see module doc)."""
    from math_verify import parse, verify

    gold_parsed = parse(_boxed(gold), parsing_timeout=None)  # type: ignore[arg-type]
    answer_parsed = parse(_boxed(answer), parsing_timeout=None)  # type: ignore[arg-type]
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _boxed(text: str) -> str:
    text = text.strip()
    if any(command in text for command in _BOX_COMMANDS):
        return text
    return "\\boxed{" + text.strip("$") + "}"


def math_score(
    response: str,
    ground_truth: str | list[str],
    *,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the final answer is equivalent to the ground truth (to any one of them, when
    given several: `truth.reference_answers`), else as documented."""
    answer = math_extract(response)
    if answer is None:
        return 0.0
    truths = [ground_truth] if isinstance(ground_truth, str) else ground_truth
    return score if any(math_verify_equal(t, answer) for t in truths) else format_score
