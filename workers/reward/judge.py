"""The reward stage's LLM judge: one verdict per trajectory from replicas of the judge's model.

`Judge(config, kafka=..., topics=..., client_id=...)`, started once per stage, holds:

- an `LLMClient` of role `judge` (`workers.llm.client`): sticky by request id, least loaded,
  a generation cut by a failing or paused replica resumed on another, exactly as the agent
  loops' client, over the judge's own replicas only. They are `reward.judge.addresses`, or
  else every replica registered on `rl.replicas` with role `judge` (`workers.llm.discovery`),
  joining and leaving at run time; a policy replica is never among them, nor is a judge ever
  among the agent loops' (they follow role `policy`);
- the judge's tokenizer (`reward.judge.model`), which encodes each rendered prompt (through
  its chat template, as one user message, unless `chat_template` is off) and decodes the
  answer;
- a semaphore of `max_in_flight`: the trajectories of a batch are judged concurrently (the
  dispatcher gathers them), at most that many requests out at once.

`verdict(request_id, text)` returns the score and its extras (`scorer: judge`, the answer's
tail, the replicas that answered) or raises: `JudgeError` when no answer came (no judge
replica within the client's wait, retries used up, past `timeout_s`), `VerdictError` when the
answer holds no verdict the parser reads (`workers.reward.verdict`). The batch applies the
failure policy.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.llm.client import LLMClient
from workers.llm.contract import SamplingParams
from workers.llm.discovery import follow_replicas
from workers.llm.exceptions import LLMError
from workers.reward.config import JudgeConfig
from workers.reward.exceptions import JudgeError, RewardError
from workers.reward.verdict import VerdictParser

__all__ = ["Judge", "judge_prompt_ids", "load_judge_tokenizer"]

log = logging.getLogger("rollout.reward.judge")

#: How much of each answer a scored trajectory keeps in `reward_extra["verdict"]`.
ANSWER_CHARS = 200


def load_judge_tokenizer(model: str) -> Any:
    """The judge model's tokenizer (transformers: the chat template needs it)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise RewardError(f"cannot load the judge's tokenizer from {model}: {exc}") from exc


def judge_prompt_ids(tokenizer: Any, text: str, *, chat_template: bool) -> list[int]:
    """`text` as the judge reads it: one user message through its chat template, or plain."""
    if not chat_template:
        return list(tokenizer(text)["input_ids"])
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class Judge:
    """Verdicts from the judge's replicas (module docstring). `start()`, then `close()`."""

    def __init__(
        self,
        config: JudgeConfig,
        *,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        client_id: str,
        tokenizer: Any | None = None,
    ) -> None:
        self.config = config
        self.kafka, self.topics, self.client_id = kafka, topics, client_id
        self.tokenizer = tokenizer
        self.parser = VerdictParser(config.verdict, config.verdict_scores)
        self.params = SamplingParams(
            max_tokens=config.max_tokens, temperature=config.temperature, logprobs=None
        )
        self.client: LLMClient | None = None
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the tokenizer, open the client, and follow the judge replicas unless named."""
        if self.tokenizer is None:
            assert self.config.model is not None, "JudgeConfig checks judge.model"
            self.tokenizer = await asyncio.to_thread(load_judge_tokenizer, self.config.model)
        self.client = LLMClient(self.config.llm, self.config.addresses, role="judge")
        await self.client.start()
        if not self.config.addresses:
            self._follower = asyncio.create_task(
                follow_replicas(
                    self.kafka,
                    self.topics,
                    self.client,
                    role="judge",
                    client_id=f"{self.client_id}-judges",
                ),
                name="judge-replicas",
            )
            self._follower.add_done_callback(_log_end)
        log.info(
            "judge ready: model %s, replicas %s",
            self.config.model,
            self.config.addresses or "discovered on rl.replicas (role judge)",
        )

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    def encode(self, text: str) -> list[int]:
        """The judge's prompt tokens for `text`."""
        assert self.tokenizer is not None, "start() loads the tokenizer"
        return judge_prompt_ids(self.tokenizer, text, chat_template=self.config.chat_template)

    async def verdict(self, request_id: str, text: str) -> tuple[float, dict[str, Any]]:
        """The judge's score of one rendered prompt; `JudgeError` or `VerdictError`."""
        assert self.client is not None and self.tokenizer is not None, "start() first"
        ids = self.encode(text)
        timeout = self.config.timeout_s
        async with self._slots:
            try:
                out = await asyncio.wait_for(
                    self.client.generate(request_id, ids, self.params), timeout
                )
            except TimeoutError:
                raise JudgeError(f"no verdict within judge.timeout_s={timeout:g}s") from None
            except LLMError as exc:
                raise JudgeError(f"no verdict: {exc}", error_class=type(exc).__name__) from exc
        answer: str = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        score = self.parser.parse(answer)
        extra = {
            "scorer": "judge",
            "verdict": answer[-ANSWER_CHARS:],
            "judge_replicas": sorted(set(out.replicas)),
        }
        return score, extra


def _log_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("following the judge replicas stopped: %r", task.exception())
