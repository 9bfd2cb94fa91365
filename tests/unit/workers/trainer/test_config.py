"""`TrainerConfig.weight_transfer`: disk stays the default; broadcast with one process."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.trainer.config import TrainerConfig


def test_disk_stays_the_default() -> None:
    assert TrainerConfig().weight_transfer == "disk"
    assert TrainerConfig(weight_transfer="broadcast").weight_transfer == "broadcast"


def test_broadcast_needs_one_trainer_process() -> None:
    with pytest.raises(ValidationError, match="one trainer process"):
        TrainerConfig(weight_transfer="broadcast", nproc=2)
    with pytest.raises(ValidationError):
        TrainerConfig(weight_transfer="nfs")
