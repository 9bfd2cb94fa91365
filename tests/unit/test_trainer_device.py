"""`trainer.device`: what the config accepts and what `resolve_device` makes of it."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from workers.trainer.config import TrainerConfig
from workers.trainer.exceptions import DeviceError
from workers.trainer.step import resolve_device


@pytest.mark.parametrize("name", ["cpu", "auto", "cuda", "cuda:0", "cuda:12"])
def test_the_config_takes_cpu_cuda_and_auto(name: str) -> None:
    assert TrainerConfig(device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "mps", " cpu"])
def test_the_config_refuses_other_devices(name: str) -> None:
    with pytest.raises(ValidationError, match="device"):
        TrainerConfig(device=name)


def test_cpu_and_auto() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want


def test_a_gpu_this_machine_lacks_is_a_clear_error() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DeviceError, match=f"cuda:{count}"):
        resolve_device(f"cuda:{count}")
    if count == 0:
        with pytest.raises(DeviceError, match="no CUDA device"):
            resolve_device("cuda")
