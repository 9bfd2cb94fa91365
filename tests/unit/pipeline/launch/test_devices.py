"""Every process of a local run owns its GPUs: replicas packed, the trainer from the rest,
everyone else none; what does not fit is refused in one line."""

from __future__ import annotations

import pytest

from pipeline.launch.devices import DeviceFitError, assign, gpu_env, visible_gpus
from pipeline.launch.local import STOP_GRACE_S
from workers.llm.engines.child_server import KILL_GRACE_S


def test_replicas_get_disjoint_packed_gpus_and_the_trainer_the_next() -> None:
    owned = assign(
        ["0", "1", "2", "3", "4"], backend="vllm", replicas=2, parallel=(2, 1, 1),
        trainer_device="auto",
    )  # fmt: skip
    assert owned == {"replica-0": "0,1", "replica-1": "2,3", "train": "4"}


def test_ids_are_the_declared_ones_not_their_positions() -> None:
    owned = assign(["4", "6"], backend="vllm", replicas=1, trainer_device="cuda")
    assert owned == {"replica-0": "4", "train": "6"}


def test_a_trainer_left_no_gpu_sees_none_on_auto_and_refuses_on_cuda() -> None:
    assert assign(["0", "1"], backend="vllm", replicas=2, trainer_device="auto")["train"] == ""
    with pytest.raises(DeviceFitError, match="needs 1 GPU"):
        assign(["0", "1"], backend="vllm", replicas=2, trainer_device="cuda")
    assert assign(["0"], backend="hf", replicas=2, trainer_device="cpu")["train"] == ""


def test_trainer_ranks_take_one_gpu_each_or_train_on_the_cpu() -> None:
    owned = assign(["0", "1", "2"], backend="vllm", replicas=1, trainer_device="auto",
                   trainer_ranks=2)  # fmt: skip
    assert owned["train"] == "1,2"
    owned = assign(["0", "1"], backend="vllm", replicas=1, trainer_device="auto", trainer_ranks=2)
    assert owned["train"] == ""


def test_hf_replicas_run_on_the_cpu_and_leave_the_gpus_to_the_trainer() -> None:
    owned = assign(["0"], backend="hf", replicas=2, trainer_device="auto")
    assert owned == {"replica-0": "", "replica-1": "", "train": "0"}


def test_what_does_not_fit_is_refused_in_one_line() -> None:
    with pytest.raises(DeviceFitError) as err:
        assign(["0", "1", "2"], backend="vllm", replicas=2, parallel=(2, 1, 1))
    assert "\n" not in str(err.value) and "do not fit" in str(err.value)
    with pytest.raises(DeviceFitError, match="cuda:0"):
        assign(["0", "1"], backend="vllm", replicas=1, trainer_device="cuda:1")


def test_visible_gpus_come_from_the_environment_or_a_given_count(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]
    assert visible_gpus(1) == ["3"]
    assert visible_gpus(4) == ["0", "1", "2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    assert gpu_env([]) == {"CUDA_VISIBLE_DEVICES": ""}


def test_a_stop_waits_longer_than_an_adapter_gives_its_engine() -> None:
    assert STOP_GRACE_S > KILL_GRACE_S
