"""Scorer dispatch: which scorer scores a trajectory, and running a batch of them at once.

Order (decided once per stage by `RewardConfig.scorer_kind`):
1. custom function when configured — called with keyword arguments `solution_str`,
   `ground_truth`, `data_source`, `extra_info`, and `trajectory` if it accepts it (or
   `**kwargs`), plus the configured `kwargs`; sync (in a thread or in the process pool) or
   async (awaited on the loop);
2. the LLM judge when enabled (`workers.reward.judge`) — one verdict per trajectory, asked for
   concurrently: the template filled with the decoded prompt and response and the reference
   answer (`workers.reward.verdict`);
3. discriminative reward model when enabled — one `/classify` request per batch;
4. the rule scorer `data_sources` names for the trajectory's `data_source`: gsm8k inline
   (it reads at most 300 characters), math in the process pool with a per-item timeout.

The response is decoded with the tokenizer (`skip_special_tokens=True`), tool and user tokens
included, as verl's reward managers do: whole for every scorer but gsm8k, which reads only the
last 300 characters and gets a decoded tail that holds them. `score_batch` never raises for one
item: each item yields a `Score` or the `RewardError` that stopped it, and the caller applies
the failure policy. Items of a batch are scored concurrently.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from workers.imports import import_object
from workers.reward.assembler import Assembled
from workers.reward.config import RewardConfig
from workers.reward.exceptions import RewardError, ScorerError, ScorerTimeout, UnknownDataSource
from workers.reward.pool import ScorerPool
from workers.reward.rm_client import RewardModelClient
from workers.reward.scorers.gsm8k import CLIP_CHARS, gsm8k_score
from workers.reward.scorers.truth import reference_answers
from workers.reward.verdict import render

if TYPE_CHECKING:
    from workers.reward.judge import Judge  # the LLM client: imported when there is a judge

__all__ = ["Dispatcher", "Score", "decode_tail", "load_custom", "normalise_result"]

log = logging.getLogger("rollout.reward.dispatch")


@dataclass
class Score:
    """A trajectory's reward and the extras that go into `reward_extra`."""

    value: float
    extra: dict[str, Any] = field(default_factory=dict)


def load_custom(path: str, name: str) -> Callable[..., Any]:
    """Import `path` and return its `name` (at start, so a typo fails the stage early)."""
    try:
        fn = import_object(f"{path}:{name}")
    except (ImportError, AttributeError) as exc:
        raise RewardError(f"cannot load custom reward function {path}:{name}: {exc}") from exc
    if not callable(fn):
        raise RewardError(f"custom reward {path}:{name} is not callable")
    return fn  # type: ignore[no-any-return]


def _accepts_trajectory(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "trajectory" or p.kind is p.VAR_KEYWORD for p in params)


def normalise_result(result: Any) -> Score:
    """A finite float/int/bool, or a dict with `score` (other keys → extras), as a `Score`."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ScorerError("custom reward returned a dict without 'score'")
        extra = {k: _plain(v) for k, v in result.items() if k != "score"}
        return Score(_finite(result["score"]), extra)
    if isinstance(result, int | float | np.number):
        return Score(_finite(result))
    raise ScorerError(
        f"a reward must be a number or a dict with 'score', got {type(result).__name__}"
    )


def _finite(value: Any) -> float:
    # NaN and inf would serialise as JSON null: an event no consumer could read.
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:
        raise ScorerError(f"a reward score must be a number, got {value!r}") from exc
    if not math.isfinite(score):
        raise ScorerError(f"a reward score must be finite, got {score}")
    return score


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


class Dispatcher:
    """Scores batches of assembled trajectories as the config says."""

    def __init__(
        self,
        config: RewardConfig,
        *,
        tokenizer: Any | None,
        pool: ScorerPool | None,
        reward_model: RewardModelClient | None = None,
        judge: Judge | None = None,
    ) -> None:
        self.config = config
        self.kind = config.scorer_kind
        self.tokenizer = tokenizer
        self.pool = pool
        self.reward_model = reward_model
        self.judge = judge
        self._custom: Callable[..., Any] | None = None
        self._custom_takes_trajectory = False
        if config.custom is not None:
            self._custom = load_custom(config.custom.path, config.custom.name)
            self._custom_takes_trajectory = _accepts_trajectory(self._custom)
        if self.kind == "reward_model" and reward_model is None:
            raise ValueError("reward_model scoring needs a RewardModelClient")
        if self.kind == "judge" and judge is None:
            raise ValueError("judge scoring needs a Judge")

    async def score_batch(self, items: list[Assembled]) -> list[Score | RewardError]:
        """One `Score` or `RewardError` per item, in order; never raises for an item."""
        if not items:
            return []
        if self.kind == "reward_model":
            return await self._score_rm(items)
        texts = self._decode(items)
        if self.kind == "judge":
            return await self._score_judge(items, texts)
        results: list[Score | RewardError | None] = [None] * len(items)
        waits: list[int] = []
        for i, (item, text) in enumerate(zip(items, texts, strict=True)):
            if self.kind == "rule" and self.config.data_sources.get(item.data_source) == "gsm8k":
                results[i] = self._gsm8k(item, text)  # microseconds: no task for it
            else:
                waits.append(i)
        if waits:
            done = await asyncio.gather(*(self._guarded(items[i], texts[i]) for i in waits))
            for i, result in zip(waits, done, strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    def _gsm8k(self, item: Assembled, text: str) -> Score | RewardError:
        if item.ground_truth is None:
            return ScorerError("gsm8k scorer needs reward_model.ground_truth; it is missing")
        try:
            truths = reference_answers(item.ground_truth)
        except ScorerError as exc:
            return exc
        g = self.config.gsm8k
        value = gsm8k_score(
            text, truths, method=g.method, format_score=g.format_score, score=g.score
        )
        return Score(value, {"scorer": "gsm8k"})

    def _decode(self, items: list[Assembled]) -> list[str]:
        """The response text of each item: whole, or only its tail where gsm8k scores it.

        Detokenizing costs far more than the gsm8k scorer; that scorer reads only the last
        `CLIP_CHARS` characters, so its items decode a suffix of tokens long enough to hold
        them (`decode_tail`). Every other scorer gets the whole response.
        """
        assert self.tokenizer is not None, "text scorers need a tokenizer"
        tail = [
            self.kind == "rule" and self.config.data_sources.get(item.data_source) == "gsm8k"
            for item in items
        ]
        whole = [i for i, t in enumerate(tail) if not t]
        texts = [""] * len(items)
        if whole:
            ids = [items[i].fields["response_ids"].tolist() for i in whole]
            decoded: list[str] = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            for i, text in zip(whole, decoded, strict=True):
                texts[i] = text
        clipped = [i for i, t in enumerate(tail) if t]
        if clipped:
            ends = decode_tail(
                self.tokenizer, [items[i].fields["response_ids"] for i in clipped], CLIP_CHARS
            )
            for i, text in zip(clipped, ends, strict=True):
                texts[i] = text
        return texts

    async def _guarded(self, item: Assembled, text: str) -> Score | RewardError:
        try:
            if self.kind == "custom":
                return await self._score_custom(item, text)
            return await self._score_rule(item, text)
        except RewardError as exc:
            return exc
        except Exception as exc:  # the user's code: any exception is a scorer failure
            log.debug("scorer raised", exc_info=True)
            return ScorerError(f"{type(exc).__name__}: {exc}", error_class=type(exc).__name__)

    async def _score_rule(self, item: Assembled, text: str) -> Score:
        scorer = self.config.data_sources.get(item.data_source)
        if scorer is None:
            raise UnknownDataSource(item.data_source)
        if item.ground_truth is None:
            raise ScorerError(f"{scorer} scorer needs reward_model.ground_truth; it is missing")
        assert self.pool is not None, "the math scorer needs the process pool"
        m = self.config.math
        result = await self.pool.run(
            "math",
            {
                "response": text,
                "ground_truth": reference_answers(item.ground_truth),
                "format_score": m.format_score,
                "score": m.score,
            },
            m.timeout_s,
        )
        return Score(float(result), {"scorer": "math"})

    async def _score_custom(self, item: Assembled, text: str) -> Score:
        custom = self.config.custom
        assert custom is not None and self._custom is not None
        timeout = self.config.scorer_timeout_s
        kwargs: dict[str, Any] = {
            "solution_str": text,
            "ground_truth": item.ground_truth,
            "data_source": item.data_source,
            "extra_info": item.extra_info,
            **custom.kwargs,
        }
        if custom.executor == "process" and not inspect.iscoroutinefunction(self._custom):
            assert self.pool is not None, "executor='process' needs the process pool"
            if self._custom_takes_trajectory:
                kwargs["trajectory"] = _plain_trajectory(item)
            request = {"path": custom.path, "name": custom.name, **kwargs}
            result = await self.pool.run("custom", request, timeout)
        else:
            if self._custom_takes_trajectory:
                kwargs["trajectory"] = item.fields
            call = (
                self._custom(**kwargs)
                if inspect.iscoroutinefunction(self._custom)
                else asyncio.to_thread(self._custom, **kwargs)
            )
            try:
                result = await asyncio.wait_for(call, timeout)
            except TimeoutError:
                raise ScorerTimeout(
                    f"custom reward exceeded {timeout:g}s", timeout_s=timeout
                ) from None
        score = normalise_result(result)
        score.extra.setdefault("scorer", "custom")
        return score

    async def _score_judge(
        self, items: list[Assembled], responses: list[str]
    ) -> list[Score | RewardError]:
        """Every item's verdict, asked for at once (the judge bounds how many are out)."""
        template = self.config.judge.template
        prompts = [""] * len(items)
        if "{prompt}" in template:
            assert self.tokenizer is not None
            ids = [item.fields["prompt_ids"].tolist() for item in items]
            prompts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        texts = [
            render(
                template,
                prompt=prompt,
                response=response,
                ground_truth=item.ground_truth,
                data_source=item.data_source,
            )
            for item, prompt, response in zip(items, prompts, responses, strict=True)
        ]
        ids = [item.fields["trajectory_id"] for item in items]
        return list(await asyncio.gather(*map(self._verdict, ids, texts)))

    async def _verdict(self, trajectory_id: str, text: str) -> Score | RewardError:
        assert self.judge is not None
        try:
            value, extra = await self.judge.verdict(f"judge:{trajectory_id}", text)
        except RewardError as exc:
            return exc
        return Score(value, extra)

    async def _score_rm(self, items: list[Assembled]) -> list[Score | RewardError]:
        assert self.reward_model is not None
        sequences = [
            [*item.fields["prompt_ids"].tolist(), *item.fields["response_ids"].tolist()]
            for item in items
        ]
        try:
            scores, version = await asyncio.wait_for(
                self.reward_model.classify(sequences), self.config.scorer_timeout_s
            )
        except TimeoutError:
            timeout = self.config.scorer_timeout_s
            error = ScorerTimeout(f"reward model exceeded {timeout:g}s", timeout_s=timeout)
            return [error] * len(items)
        except RewardError as exc:
            return [exc] * len(items)
        extra = {"scorer": "reward_model", "rm_version": version}
        return [Score(s, dict(extra)) for s in scores]

    async def close(self) -> None:
        if self.reward_model is not None:
            await self.reward_model.close()
        if self.judge is not None:
            await self.judge.close()


def decode_tail(tokenizer: Any, arrays: list[np.ndarray], chars: int) -> list[str]:
    """Text that ends each token array and holds at least its last `chars` characters.

    Decodes a suffix of 128 tokens; for the arrays whose text is still shorter than `chars`
    plus a margin (the first token of a suffix may decode differently from the same token
    in context: a split multi-byte character), decodes again a suffix sized from the
    characters per token seen so far (with a quarter to spare, at least twice as long), up
    to the whole array; a whole array's text is returned as is. So
    `decode_tail(...)[i][-chars:]` equals the last `chars` characters of the whole decode.
    """
    out = [""] * len(arrays)
    want = chars + 8
    windows = dict.fromkeys(range(len(arrays)), 128)
    while windows:
        todo = list(windows)
        ids = [arrays[i][-windows[i] :].tolist() for i in todo]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        again: dict[int, int] = {}
        for i, text in zip(todo, texts, strict=True):
            window = windows[i]
            if len(arrays[i]) <= window or len(text) >= want:
                out[i] = text
            else:
                per_token = max(len(text), 1) / window
                again[i] = max(2 * window, int(want / per_token * 1.25) + 1)
        windows = again
    return out


def _plain_trajectory(item: Assembled) -> dict[str, Any]:
    """The trajectory as JSON-able data for a custom function in the process pool."""
    out: dict[str, Any] = {}
    for key, value in item.fields.items():
        if isinstance(value, np.ndarray):
            out[key] = value.tolist()
        elif hasattr(value, "model_dump"):
            out[key] = value.model_dump(mode="json")
        else:
            out[key] = value
    return out
