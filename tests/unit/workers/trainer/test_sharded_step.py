"""`sharded_train_step` in a world of one gloo rank (issue 42's defects of the sharded step).

- On GPUs the default process group is NCCL, which takes no CPU tensor: the step's own
  collectives (the loss, the metric rows) must go to the control group it is given (gloo), never
  a CPU tensor to the default group.
- A micro-batch without routing (r3, where some samples carry none) has fewer metric keys than
  one with: the rows every rank gathers must still line up.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from workers.trainer.config import TrainerConfig


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[Any]:
    """A gloo world of one rank in this process, and a gloo control group beside it."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def _moe_batch(with_routing: int) -> tuple[Any, Any]:
    """(model B, batch of 4 samples) with the first `with_routing` samples' routing recorded
    by checkpoint A."""
    from tests.unit.workers.trainer.moe_helpers import (
        make_batch,
        moe_model,
        perturbed,
        routed,
        sequences,
    )

    a = moe_model(0)
    pairs = sequences()
    routing = [routed(a, p + r) if i < with_routing else None for i, (p, r) in enumerate(pairs)]
    return perturbed(a), make_batch(pairs, routing)


def test_the_step_sends_no_cpu_tensor_to_the_default_group(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.trainer.sharded_step import sharded_train_step

    calls: list[tuple[str, Any, list[str]]] = []

    def spy(name: str) -> Any:
        real = getattr(dist, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a]
            group = kwargs.get("group")
            calls.append((name, group, [t.device.type for t in tensors]))
            return real(*args, **kwargs)

        return wrapper

    for name in ("all_reduce", "all_gather", "broadcast", "reduce", "gather"):
        monkeypatch.setattr(dist, name, spy(name))
    model, batch = _moe_batch(with_routing=4)
    config = TrainerConfig(micro_batch_size=2, router_replay="r3", lr=1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    sharded_train_step(model.train(), optimizer, batch, config, rank=0, world=1, group=one_rank)
    assert calls, "the step made no collective call of its own"
    for name, group, devices in calls:
        default = group is None or group == dist.group.WORLD
        assert not (default and "cpu" in devices), f"{name}: a CPU tensor to the default group"


def test_micro_batches_with_and_without_routing_gather_into_the_step_metrics(one_rank: Any) -> None:
    """r3, micro-batches of two: samples 0-1 carry routing, 2-3 none. The gathered rows line up
    (they failed to before: each row took its own micro-batch's keys) and the step's figures
    are the one-process step's."""
    from workers.trainer.sharded_step import sharded_train_step
    from workers.trainer.step import train_step

    model, batch = _moe_batch(with_routing=2)
    config = TrainerConfig(micro_batch_size=2, router_replay="r3", lr=1e-3)
    other = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    sharded = sharded_train_step(
        model.train(), optimizer, batch, config, rank=0, world=1, group=one_rank
    )
    one = train_step(
        other.train(), torch.optim.AdamW(other.parameters(), lr=config.lr), batch, config
    )
    assert sharded["router_rows"] == one["router_rows"] > 0
    assert sharded["tokens"] == one["tokens"]
    assert sharded["loss"] == pytest.approx(one["loss"], rel=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a rank that sees no GPU")
def test_a_rank_given_no_gpu_refuses_cuda_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank the launcher gave no GPU (CUDA_VISIBLE_DEVICES="") never takes another's cuda:0:
    with trainer.device=cuda it refuses before joining the world."""
    from workers.trainer.exceptions import DeviceError
    from workers.trainer.sharded import init_ranks

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match="sees no CUDA device") as err:
        init_ranks(TrainerConfig(device="cuda"))
    assert "\n" not in str(err.value)
    assert not dist.is_initialized()
