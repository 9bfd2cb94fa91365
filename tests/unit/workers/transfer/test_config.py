"""The run's `weight_transfer` section (`WeightTransferConfig`), through the run config."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from workers.transfer.config import WeightTransferConfig


def test_defaults_and_settings() -> None:
    assert load_config(None, {}).weight_transfer == WeightTransferConfig()
    cfg = load_config(
        None,
        {"trainer": {"weight_transfer": "broadcast"}, "weight_transfer": {"timeout_s": 5}},
    )
    assert cfg.trainer.weight_transfer == "broadcast" and cfg.weight_transfer.timeout_s == 5


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"bucket_mb": 0}, "bucket_mb"),
        ({"backend": "mpi"}, "backend"),
    ],
)
def test_a_wrong_value_names_its_field(section: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"weight_transfer\.{field}"):
        load_config(None, {"weight_transfer": section})
