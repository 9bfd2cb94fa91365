"""A small LLM judge for the demo's task: the tiny model, warm-started to answer in the verdict
format of `reward.judge`.

`warm_judge(model_dir, judge)` writes a fresh tiny model (`init_model`) and fine-tunes it in
place (`recipe.fine_tune`, the machinery of the demo's own warm start) on the judge's prompts
exactly as the reward stage writes them: the arithmetic task's problems (prompt decoded from
the policy's chat template, as the stage decodes `prompt_ids`), each with a response in one of
the policy's styles (`#### n`, `The answer is n.`, a bare number, right or wrong, words
without a number, or characters at random as an untrained policy writes), rendered through
`judge.template` and encoded by `judge_prompt_ids`. The target is `Verdict: 1` when the gsm8k
rule (flexible: the last number) finds the reference answer, else `Verdict: 0`, then eos.
A problem whose reference answer is `UNJUDGEABLE` gets `I cannot judge this.` instead, which
no verdict pattern of the default kind reads: a test produces unparseable verdicts on purpose
with it.

`python -m pipeline.harness.demo.judge` warm-starts one and prints how often its greedy
answers parse and agree with the rule on problems it was not trained on.
"""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.reward.config import JudgeConfig

__all__ = ["UNJUDGEABLE", "JudgeExample", "evaluate_judge", "judge_examples", "warm_judge"]

#: A reference answer the warm-started judge refuses to judge (no verdict in its answer).
UNJUDGEABLE = "?"
REFUSAL = "I cannot judge this."
#: Share of training problems given `UNJUDGEABLE` as their reference answer.
UNJUDGEABLE_SHARE = 0.1
_JUNK = string.ascii_letters + string.digits + string.punctuation + " \n"


@dataclass(frozen=True)
class JudgeExample:
    """One judge training example: the row, the policy's response, and what the judge says."""

    row: dict[str, Any]
    response: str
    target: str


def judge_examples(rows: list[dict[str, Any]], rng: random.Random) -> list[JudgeExample]:
    """One example per row (pure: no model). About half the responses are right."""
    from workers.reward.scorers.gsm8k import gsm8k_score

    out = []
    for row in rows:
        truth = str(row["reward_model"]["ground_truth"])
        if rng.random() < UNJUDGEABLE_SHARE:
            row = {**row, "reward_model": {**row["reward_model"], "ground_truth": UNJUDGEABLE}}
        answer = truth if rng.random() < 0.5 else str(int(truth) + rng.choice([-2, -1, 1, 2, 5]))
        style = rng.random()
        if style < 0.3:
            response = f"#### {answer}"
        elif style < 0.6:
            response = f"The answer is {answer}."
        elif style < 0.7:
            response = answer
        elif style < 0.8:
            response = rng.choice(["I do not know.", "The answer is", "####", "Let me think."])
        else:  # what an untrained policy says: characters at random
            response = "".join(rng.choice(_JUNK) for _ in range(rng.randint(1, 24)))
        reference = str(row["reward_model"]["ground_truth"])
        if reference == UNJUDGEABLE:
            target = REFUSAL
        else:
            target = f"Verdict: {int(gsm8k_score(response, reference, method='flexible'))}"
        out.append(JudgeExample(row, response, target))
    return out


def _prompt_text(tokenizer: Any, row: dict[str, Any]) -> str:
    """The row's prompt as the reward stage sees it: the policy's chat prompt, decoded."""
    ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


def judge_text(tokenizer: Any, judge: JudgeConfig, example: JudgeExample) -> str:
    """The judge's prompt text for `example`, rendered as the reward stage renders it."""
    from workers.reward.verdict import render

    row = example.row
    return render(
        judge.template,
        prompt=_prompt_text(tokenizer, row),
        response=example.response,
        ground_truth=row["reward_model"]["ground_truth"],
        data_source=row["data_source"],
    )


def warm_judge(
    model_dir: str | Path,
    judge: JudgeConfig,
    *,
    steps: int = 200,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    max_operand: int = 3,
) -> float:
    """A tiny judge at `model_dir`, fine-tuned on `judge`'s prompt format; seconds it took.

    The defaults, measured with `python -m pipeline.harness.demo.judge` (two busy cores): 200
    steps of 8 at lr 3e-3 take ~38 s, and every held-out answer parses, every taught refusal
    refuses, 64% of the verdicts agree with the rule; 150 of 16 took 39 s (66%), 300 of 16 at
    2e-3 115 s. It learns the format; the comparison only partly."""
    from transformers import AutoTokenizer

    from pipeline.data.arithmetic import arithmetic_rows
    from pipeline.harness.models.tiny import init_model
    from pipeline.harness.recipe import fine_tune
    from workers.reward.judge import judge_prompt_ids

    started = time.monotonic()
    init_model(model_dir, "tiny", seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    rows = arithmetic_rows(1000, seed=seed, max_operand=max_operand)
    pairs = [
        (
            judge_prompt_ids(
                tokenizer, judge_text(tokenizer, judge, ex), chat_template=judge.chat_template
            ),
            [*tokenizer(ex.target)["input_ids"], tokenizer.eos_token_id],
        )
        for ex in judge_examples(rows, rng)
    ]
    fine_tune(model_dir, pairs, steps=steps, batch=batch, lr=lr, rng=rng)
    return time.monotonic() - started


def evaluate_judge(
    model_dir: str | Path, judge: JudgeConfig, *, n: int = 64, seed: int = 99
) -> dict[str, float]:
    """Greedy answers of the judge at `model_dir` on `n` fresh examples: the share that parse,
    that agree with the rule, and (of the unjudgeable) that refuse."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.arithmetic import arithmetic_rows
    from workers.reward.exceptions import VerdictError
    from workers.reward.judge import judge_prompt_ids
    from workers.reward.verdict import VerdictParser

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    parser = VerdictParser(judge.verdict, judge.verdict_scores)
    examples = judge_examples(arithmetic_rows(n, seed=seed, max_operand=3), random.Random(seed))
    parsed = agree = refused = unjudgeable = 0
    for ex in examples:
        ids = judge_prompt_ids(
            tokenizer, judge_text(tokenizer, judge, ex), chat_template=judge.chat_template
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=judge.max_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        answer = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        if ex.target == REFUSAL:
            unjudgeable += 1
        try:
            score = parser.parse(answer)
        except VerdictError:
            refused += ex.target == REFUSAL
            continue
        parsed += 1
        agree += f"Verdict: {int(score)}" == ex.target
    judgeable = len(examples) - unjudgeable
    return {
        "parsed": parsed / max(judgeable, 1),
        "agree": agree / max(judgeable, 1),
        "refused": refused / max(unjudgeable, 1),
    }


def main() -> None:
    import argparse
    import logging
    import tempfile

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--template", default="Reference: {ground_truth}\nAnswer: {response}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    judge = JudgeConfig(template=args.template, max_tokens=16)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "judge"
        took = warm_judge(
            model_dir, judge, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed
        )
        print(f"warm start {took:.1f}s; held out: {evaluate_judge(model_dir, judge)}")


if __name__ == "__main__":
    main()
