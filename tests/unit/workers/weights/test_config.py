"""The run's `weights` section (`WeightsConfig`): the way and its parameters in one place, the
old names refused in one line."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from workers.weights.config import WeightsConfig


def test_defaults_and_settings() -> None:
    assert load_config(None, {}).weights == WeightsConfig()
    assert load_config(None, {}).weights.mode == "disk"
    cfg = load_config(None, {"weights": {"mode": "broadcast", "timeout_s": 5}})
    assert cfg.weights.mode == "broadcast" and cfg.weights.timeout_s == 5


def test_broadcast_needs_one_trainer_process() -> None:
    with pytest.raises(ConfigError, match="one trainer process"):
        load_config(None, {"weights": {"mode": "broadcast"}, "trainer": {"nproc": 2}})
    with pytest.raises(ConfigError, match=r"weights\.mode"):
        load_config(None, {"weights": {"mode": "nfs"}})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            {"trainer": {"weight_transfer": "broadcast"}},
            "trainer.weight_transfer is renamed to weights.mode",
        ),
        ({"weight_transfer": {"timeout_s": 5}}, "weight_transfer is renamed to weights"),
    ],
)
def test_the_old_names_are_refused_with_the_new_one(old: dict, new: str) -> None:
    with pytest.raises(ConfigError, match=new):
        load_config(None, old)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"bucket_mb": 0}, "bucket_mb"),
        ({"backend": "mpi"}, "backend"),
    ],
)
def test_a_wrong_value_names_its_field(section: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"weights\.{field}"):
        load_config(None, {"weights": section})
