"""`trainer.lend`: when the trainer withdraws, and which configurations refuse lending."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.trainer.config import LendConfig, TrainerConfig
from workers.trainer.lend import reclaim_threshold


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
