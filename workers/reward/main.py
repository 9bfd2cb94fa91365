"""Start the reward stage: `run_worker(kafka, topics, reward)` (what `rollout worker reward` runs).

A `StageWorker` (`workers.kafka.stage_worker`): checks the config, reads the source topic's
partition count from the broker (the table's changelog is created with as many), loads the
tokenizer, then runs the stage until SIGTERM or SIGINT (graceful: the batch in flight
finishes and is committed) or SIGKILL (nothing is lost: uncommitted turns are redelivered
and the stage de-duplicates).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.stage_worker import StageWorker
from workers.reward.config import RewardConfig
from workers.reward.exceptions import RewardError

if TYPE_CHECKING:
    from workers.metrics import StageMetrics
    from workers.reward.app import RewardStage

__all__ = ["FastDetokenizer", "load_tokenizer", "run_worker"]


class FastDetokenizer:
    """`batch_decode` straight from a `tokenizer.json` with the `tokenizers` library.

    The stage only turns token ids back into text; loading the same file through
    transformers' AutoTokenizer imports torch, which made a restarted reward worker take
    tens of seconds on a busy machine before it read its first record.
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        texts: list[str] = self._tokenizer.decode_batch(
            ids, skip_special_tokens=skip_special_tokens
        )
        return texts


def load_tokenizer(path: str) -> Any:
    """A detokenizer for the model at `path`: its `tokenizer.json` if it has one, else
    transformers' AutoTokenizer (slow tokenizers, remote formats)."""
    fast = Path(path) / "tokenizer.json"
    try:
        if fast.is_file():
            return FastDetokenizer(fast)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # tokenizers raises plain Exception on a bad file
        raise RewardError(f"cannot load the tokenizer from {path}: {exc}") from exc


def _build(
    kafka: KafkaConfig, topics: TopicsConfig, config: RewardConfig, metrics: StageMetrics | None
) -> RewardStage:
    from workers.reward.app import RewardStage

    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    return RewardStage(kafka, topics, config, tokenizer=tokenizer, metrics=metrics)


run_worker: StageWorker[RewardConfig] = StageWorker(
    name="reward",
    source="turns",
    build=_build,
    error=RewardError,
    check=RewardConfig.missing_for_start,
)
