"""Teach a tiny model to call the calculator in its own chat format, before any RL.

The tool agent can only be shown working on a model that makes calls. A freshly initialised
tiny model (`rollout model init --template FAMILY`) makes none, so, as the demo's warm start
does for answers, a few hundred supervised steps teach it the tool round of its format:

    question ──► call turn (mask 1) ──► tool block (mask 0) ──► answer turn `#### n` (mask 1)

Every sample is built with the agent loop's own `ChatFormat` from the model's template: the
call turn is what the template renders for an assistant message with the call, up to the
token the loop stops on; the tool block is `ChatFormat.tool_block_ids` with the calculator's
real result; the answer turn ends on the model's end of turn. So the model is trained on
token for token what the tool agent will feed it and expect from it, in any family, and
cross-entropy counts only the model's own tokens.

`python -m pipeline.harness.demo.tool_warm_start --template mistral` builds a model in a temporary
directory, warm-starts it and prints how often sampled first turns parse as calls.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ToolRecipe", "call_rate", "tool_samples", "tool_warm_start"]

log = logging.getLogger("rollout.demo.tools")


@dataclass(frozen=True)
class ToolRecipe:
    """The warm start's numbers: steps, prompts a step, lr, operands, seed."""

    steps: int = 150
    batch: int = 8
    lr: float = 4e-3
    max_operand: int = 9
    seed: int = 0


def _calculator_schema() -> dict[str, Any]:
    from workers.agent_loop.tools.calculator import CalculatorTool

    return CalculatorTool().openai_schema()


def question_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's prompt for the tool round: its bare question (`What is a op b?`)."""
    return [{"role": "user", "content": row["extra_info"]["question"]}]


def tool_samples(
    tokenizer: Any, rows: list[dict[str, Any]]
) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, response ids, response mask) per row: one call of the calculator on the
    row's expression, its result, and the answer `#### n`."""
    from workers.agent_loop.chat_format import ChatFormat
    from workers.agent_loop.tools.calculator import evaluate

    chat = ChatFormat.load(tokenizer)
    tools = [_calculator_schema()]
    stops = set(chat.stop_ids(tool_calls=True))
    samples = []
    for row in rows:
        messages = question_messages(row)
        expression = row["extra_info"]["question"].removeprefix("What is ").rstrip("?")
        result = str(evaluate(expression))
        call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
        call["function"]["arguments"] = {"expression": expression}
        asked = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
        answered = [*asked, {"role": "tool", "content": result, "name": "calculator"}]
        prompt = chat.prompt_ids(messages, tools)
        call_turn = _turn(chat, messages, asked, tools, stops)
        block = chat.tool_block_ids(messages, tools, answered[-1:], chat.text_of(call_turn[-1]))
        final = [*answered, {"role": "assistant", "content": f"#### {result}"}]
        answer_turn = _turn(chat, answered, final, tools, stops)
        response = call_turn + block + answer_turn
        mask = [1] * len(call_turn) + [0] * len(block) + [1] * len(answer_turn)
        samples.append((prompt, response, mask))
    return samples


def _turn(
    chat: Any,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    stops: set[int],
) -> list[int]:
    """The assistant turn `after` adds to `before`, as the model generates it: the template's
    text past the generation prompt, up to the first token the loop stops on."""
    start = chat.render(before, tools, gen=True)
    text = chat.render(after, tools, gen=False)
    if not text.startswith(start):
        raise ValueError("the template renders a turn differently once another follows")
    ids = chat.tokenizer.encode(text[len(start) :], add_special_tokens=False)
    end = next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))
    return list(ids[:end])


def tool_warm_start(model_dir: str | Path, recipe: ToolRecipe) -> float:
    """Supervised steps on the tool round, in place at `model_dir`; returns the seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.arithmetic import arithmetic_rows

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = arithmetic_rows(512, seed=recipe.seed, max_operand=recipe.max_operand)
    samples = tool_samples(tokenizer, rows)
    shared = _shared_prefix([prompt for prompt, _, _ in samples])
    rng = random.Random(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    # Decaying to 0 leaves less mass on rare wrong tokens than a constant rate does.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / recipe.steps)
    model.train()
    for step in range(recipe.steps):
        loss = _loss(model, shared, rng.sample(samples, recipe.batch), tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == recipe.steps - 1:
            log.info("tool warm start step %d/%d: loss %.3f", step + 1, recipe.steps, loss.item())
    model.eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return time.monotonic() - started


def _shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The tokens every prompt starts with (the template's tools block), one short of the
    shortest prompt so each keeps a token of its own."""
    shared = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for prompt in prompts[1:]:
        shared = next((i for i in range(shared) if prompt[i] != first[i]), shared)
    return first[:shared]


def _loss(
    model: Any, shared: list[int], batch: list[tuple[list[int], list[int], list[int]]], pad: int
) -> Any:
    """Mean cross-entropy of the masked response tokens. The prompts' shared prefix (most of
    each prompt: the tool definitions) runs once, without gradient, as the KV cache of the
    rest, which runs with it: the same logits at a fraction of the cost."""
    import torch
    from transformers import DynamicCache

    from workers.llm.engines.hf.kv_batch import cache_kwarg

    cache = DynamicCache()  # filled in place by the forward
    with torch.no_grad():
        model(input_ids=torch.tensor([shared]), use_cache=True, **{cache_kwarg(model): cache})
    cache.batch_repeat_interleave(len(batch))
    rests = [prompt[len(shared) :] + response for prompt, response, _ in batch]
    width = max(map(len, rests))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention = torch.zeros((len(batch), len(shared) + width), dtype=torch.long)
    weights = torch.zeros((len(batch), width))
    for i, (rest, (prompt, _, mask)) in enumerate(zip(rests, batch, strict=True)):
        ids[i, : len(rest)] = torch.tensor(rest)
        attention[i, : len(shared) + len(rest)] = 1
        start = len(prompt) - len(shared)
        weights[i, start : len(rest)] = torch.tensor(mask, dtype=weights.dtype)
    positions = torch.arange(len(shared), len(shared) + width).expand(len(batch), -1)
    logits = model(
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions,
        **{cache_kwarg(model): cache},
    ).logits
    # Position t predicts token t + 1; the first of each rest is prompt, never a target.
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    target = weights[:, 1:]
    return -(logp * target).sum() / target.sum()


def call_rate(
    model_dir: str | Path, prompts: int = 32, seed: int = 1, temperature: float = 1.0
) -> float:
    """Share of first turns, sampled at `temperature`, that parse as calls without error."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.arithmetic import arithmetic_rows
    from pipeline.harness.recipe import sample
    from workers.agent_loop.chat_format import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    chat = ChatFormat.load(tokenizer)
    tools = [_calculator_schema()]
    parser = chat.parser(tools)
    stops = chat.stop_ids(tool_calls=True)
    good = 0
    torch.manual_seed(seed)
    for row in arithmetic_rows(prompts, seed=seed, max_operand=9):
        prompt = torch.tensor([chat.prompt_ids(question_messages(row), tools)])
        out = sample(
            model,
            prompt,
            torch.ones_like(prompt),
            max_tokens=64,
            eos=stops,
            pad=tokenizer.pad_token_id,
            temperature=temperature,
        )
        text = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=False)
        _, calls = parser.parse(text)
        good += bool(calls) and all(c.error is None for c in calls)
    return good / prompts


def main() -> None:
    import argparse
    import tempfile

    import torch

    from pipeline.harness.models.templates import FAMILY_NAMES
    from pipeline.harness.models.tiny import init_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", choices=FAMILY_NAMES, default="hermes")
    for name, value in ToolRecipe().__dict__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    template = args.__dict__.pop("template")
    recipe = ToolRecipe(**args.__dict__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model(Path(tmp) / "model", seed=recipe.seed, template=template)
        seconds = tool_warm_start(model_dir, recipe)
        rates = {t: call_rate(model_dir, prompts=64, temperature=t) for t in (1.0, 0.7)}
    shown = ", ".join(f"{rate:.0%} at temperature {t:g}" for t, rate in rates.items())
    print(f"{template}: {recipe.steps} steps in {seconds:.1f}s; calls parsed: {shown}")


if __name__ == "__main__":
    main()
