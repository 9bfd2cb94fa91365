"""`trainer.lend`: when the trainer lends and withdraws, and which configurations refuse it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.llm.engines.hf.config import HFEngineConfig
from workers.trainer.config import LendConfig, TrainerConfig
from workers.trainer.lend import lend_action, reclaim_threshold


@pytest.mark.parametrize(
    ("ratio", "batch", "threshold"),
    [(0.75, 8, 6), (0.5, 2, 1), (1.0, 8, 8), (0.01, 8, 1), (0.3, 10, 3), (0.5, 1, 1)],
)
def test_the_trainer_withdraws_at_a_share_of_its_batch(
    ratio: float, batch: int, threshold: int
) -> None:
    assert reclaim_threshold(ratio, batch) == threshold


def test_lending_is_off_by_default_and_the_ratio_is_a_share() -> None:
    assert TrainerConfig().lend == LendConfig(enable=False)
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError, match="reclaim_ratio"):
            LendConfig(reclaim_ratio=bad)


def test_a_sharded_trainer_refuses_lending_in_one_line() -> None:
    with pytest.raises(ValidationError, match=r"trainer\.lend needs nproc=1, not 2"):
        TrainerConfig(nproc=2, lend={"enable": True})
    assert TrainerConfig(nproc=2).lend.enable is False  # sharded without lending: as before


def _asked(queued: int, calls: list[int]):
    def ask() -> int:
        calls.append(queued)
        return queued

    return ask


@pytest.mark.parametrize(
    ("ready", "queued", "lent", "action", "asked"),
    [
        (0, 0, False, "lend", True),  # nothing ready, nothing waiting: the trainer would idle
        (0, 5, False, "lend", True),  # 5 waiting of 6 needed: it still waits for the sixth
        (0, 6, False, "decline", True),  # the batch is already on the topic: no lend
        (2, 4, False, "decline", True),  # collected and waiting together reach the threshold
        (5, 0, True, None, False),  # lent, not enough ready: stays lent, the topic not asked
        (6, 0, True, "withdraw", False),  # enough ready: back to training
        (6, 0, False, None, False),  # enough ready and withdrawn already
    ],
)
def test_the_trainer_lends_only_when_it_would_wait(
    ready: int, queued: int, lent: bool, action: str | None, asked: bool
) -> None:
    calls: list[int] = []
    assert lend_action(ready, _asked(queued, calls), 6, lent=lent) == action
    assert bool(calls) is asked  # the broker is asked only when a lend is in question


def test_the_lent_engine_is_as_large_as_a_standalone_replica_by_default() -> None:
    # Routing by load shares requests by the capacities replicas report: a smaller default
    # gave the lent engine a fifth of each batch beside one replica (issue 30).
    assert LendConfig().max_batch == HFEngineConfig().max_batch
