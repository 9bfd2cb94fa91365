"""The NCCL-only settings of a transfer group, checked on a CPU by what the code passes.

No GPU here: `ProcessGroupNCCL` cannot be built, so a recorder stands in for the class and
captures the options and the environment at the moment the group would be built (torch reads
`TORCH_NCCL_*` in that constructor). The rest runs for real: the hub's NCCL environment line,
grants that give NCCL only to a replica that takes it (the others receive the same transfer
over gloo), and a receiver whose NCCL setting differs from the trainer's refusing before it
joins.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from workers.weights import group as group_module
from workers.weights.group import nccl_options, open_group, store_client
from workers.weights.hub import TransferHub
from workers.weights.protocol import MEMBERS, Grant, Want, grant_key, joined_key, want_key
from workers.weights.receive import receive, receive_buckets

SETTINGS = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_CUMEM_ENABLE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_nccl_group_gets_its_timeout_non_blocking_init_and_error_handling(clean_env) -> None:
    built: list[dict[str, Any]] = []

    class Recorder:
        Options = dist.ProcessGroupNCCL.Options

        def __init__(self, store: Any, rank: int, world: int, options: Any) -> None:
            env = {name: os.environ.get(name) for name in SETTINGS}
            built.append({"rank": rank, "world": world, "options": options, "env": env})

    clean_env.setattr(group_module.dist, "ProcessGroupNCCL", Recorder)
    store = dist.HashStore()
    open_group(store, "group/1/r", 1, 3, timeout_s=7.5, backend="nccl")
    (seen,) = built
    assert (seen["rank"], seen["world"]) == (1, 3)
    assert seen["options"]._timeout == timedelta(seconds=7.5)
    assert seen["options"].config.blocking == 0  # init waited for with the timeout, aborted
    assert seen["env"] == {
        "TORCH_NCCL_BLOCKING_WAIT": "1",  # wait() raises in the caller; no watchdog
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: never tears the process down
        "NCCL_CUMEM_ENABLE": "0",  # what vLLM's processes run with
    }
    print("ProcessGroupNCCL built with", seen["env"], "timeout", seen["options"]._timeout)


def test_nccl_options_alone() -> None:
    options = nccl_options(3)
    assert options._timeout == timedelta(seconds=3) and options.config.blocking == 0


def _want(hub: TransferHub, want: Want) -> Any:
    store = dist.PrefixStore(hub.session + "/", store_client(hub.address, 5))
    store.set(want_key(want.replica), want.dumps())
    store.append(MEMBERS, want.replica + "\n")
    return store


def test_an_nccl_hub_says_its_environment_and_grants_nccl_only_to_who_takes_it(
    clean_env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollout.transfer.hub")
    hub = TransferHub(
        host="127.0.0.1",
        port=0,
        session=uuid.uuid4().hex[:8],
        timeout_s=2.0,
        bucket_bytes=4096,
        backend="nccl",
    )
    try:
        lines = [r.getMessage() for r in caplog.records if "NCCL weight transfers" in r.message]
        assert len(lines) == 1 and "NCCL_CUMEM_ENABLE=0" in lines[0], lines
        assert "TORCH_NCCL_BLOCKING_WAIT=1" in lines[0]
        assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
        hf = Want("hf", uuid.uuid4().hex, -1)  # says nothing of NCCL: gloo only
        gpu = Want("gpu", uuid.uuid4().hex, -1, 1, None, ("gloo", "nccl"))  # never joins
        stores = {w.replica: _want(hub, w) for w in (hf, gpu)}
        weights = {"w": torch.arange(64, dtype=torch.float32)}
        got: dict[str, torch.Tensor] = {}

        def hf_replica() -> None:
            store = stores["hf"]
            store.wait([grant_key(hf.nonce)])
            got.update(receive(Grant.loads(store.get(grant_key(hf.nonce))).as_dict()))

        thread = threading.Thread(target=hf_replica)
        thread.start()
        report = hub.send(list(weights.items()), 1, hub.pending())
        thread.join()
        grants = {
            w.replica: Grant.loads(stores[w.replica].get(grant_key(w.nonce))) for w in (hf, gpu)
        }
        assert grants["hf"].backend == "gloo" and grants["hf"].env is None
        assert grants["gpu"].backend == "nccl" and grants["gpu"].env == {"NCCL_CUMEM_ENABLE": "0"}
        assert report.receivers == ["hf"] and report.not_joined == ["gpu"]
        assert torch.equal(got["w"], weights["w"])
        assert hub.benched == set()
        hub.release(report.not_joined)
        assert hub.pending() == [] and hub.benched == {"gpu"}
    finally:
        hub.close()


def test_a_receiver_whose_nccl_setting_differs_refuses_before_joining(clean_env) -> None:
    clean_env.setenv("NCCL_CUMEM_ENABLE", "1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    grant = Grant(
        version=1,
        transfer=1,
        address=f"127.0.0.1:{store.port}",
        session="s",
        group="group/1/r",
        manifest="manifest/1",
        rank=1,
        world=2,
        timeout_s=2.0,
        backend="nccl",
        env={"NCCL_CUMEM_ENABLE": "0"},
    )
    with pytest.raises(ValueError, match="NCCL_CUMEM_ENABLE=1 here, 0 at the trainer"):
        next(receive_buckets(grant.as_dict()))
    assert not dist.PrefixStore("s/", store).check([joined_key("group/1/r", 1)])
