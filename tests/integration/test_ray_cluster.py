"""`rollout up --ray` on a cluster of two GPU nodes, simulated on one CPU machine: every
process sees only its own GPUs, the trainer's ranks are one placement group, the fit check
counts each node's replicas, and nothing announced is a loopback address.

`ray.cluster_utils.Cluster` with nodes of 2 and 4 GPUs (declared: Ray hands out ids, no GPU
exists). Real broker; vLLM is `stub_vllm.py` answering `/health`, so each replica registers
on `rl.replicas` through the real adapter and the real registration.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipeline.launch.devices import VISIBLE
from pipeline.launch.ray.stages import LaunchError, _trainer_address_args, down, up
from pipeline.launch.ray.trainer import place_ranks, rank_env
from schemas import decode
from tests.integration.test_pipeline_e2e import pipeline_config
from tests.integration.test_up_devices import _environ, _stub_python
from tests.integration.trainer_helpers import read_all
from workers.ports import SPANS_NODES_ENV, is_loopback

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.long]

MB = 1024**2


@pytest.fixture(scope="module")
def two_gpu_nodes():
    """A Ray cluster of its own (never one that runs here): nodes of 2 and 4 GPUs."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 2, "object_store_memory": 80 * MB},
    )
    try:
        cluster.add_node(num_cpus=2, num_gpus=4, object_store_memory=80 * MB)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rollout-pipeline", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _gpus_by_node(owned: dict[str, tuple[str, list[str]]]) -> None:
    """No GPU of a node is owned twice."""
    seen: dict[tuple[str, str], str] = {}
    for name, (node, gpus) in owned.items():
        for gpu in gpus:
            assert (node, gpu) not in seen, (name, seen[(node, gpu)], owned)
            seen[(node, gpu)] = name


@pytest.mark.timeout(420)
def test_a_run_on_two_gpu_nodes_owns_disjoint_gpus_and_announces_no_loopback(
    two_gpu_nodes, kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    import ray

    # Ranks: one placement group, packed (both fit the 4-GPU node), one GPU each.
    group, ranks, places = place_ranks(2, 1, tmp_path / "logs", 60)
    try:
        assert {p["placement_group"] for p in places} == {group.id.hex()}
        assert len({p["node_id"] for p in places}) == 1
        envs = rank_env(places)
        assert [e[VISIBLE] for e in envs] == [",".join(p["gpus"][0] for p in places)] * 2
        assert len({p["gpus"][0] for p in places}) == 2
    finally:
        for actor in ranks:
            ray.kill(actor)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
    deadline = time.monotonic() + 30  # the group's GPUs come back (the run sizes from free)
    while time.monotonic() < deadline and ray.available_resources().get("GPU", 0) < 6:
        time.sleep(0.2)

    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    stub = _stub_python(tmp_path)
    cfg = cfg.model_copy(
        update={
            "vllm": cfg.vllm.model_copy(update={"python": str(stub)}),
            "trainer": cfg.trainer.model_copy(update={"device": "auto"}),
        }
    )
    run = topics_config.prefix.rstrip(".")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    stub_env = {"STUB_VLLM_DIR": str(stubs), "STUB_VLLM_HEALTHY": "1"}
    common = dict(address=two_gpu_nodes.address, run_dir=tmp_path / "run", run=run,
                  model_dir=str(tiny_model), backend="vllm", stages=("train",),
                  extra_env=stub_env)  # fmt: skip
    # Four replicas of 2 GPUs do not fit nodes of 2 and 4 (one + two), whatever the total.
    with pytest.raises(LaunchError, match=r"nodes of (2, 4|4, 2) GPUs hold 3"):
        up(cfg, replicas=4, parallel=(2, 1, 1), **common)
    try:
        rows = up(cfg, replicas=2, parallel=(2, 1, 1), **common)
        stages = {r["stage"]: r for r in rows}
        owned = {}
        for name, row in stages.items():
            place = ray.get(ray.get_actor(f"{run}/{name}").where.remote())
            env = _environ(row["pid"])
            owned[name] = (place["node_id"], [g for g in env[VISIBLE].split(",") if g])
            assert env[VISIBLE] == ",".join(place["gpus"]), (name, env[VISIBLE], place)
            assert env[SPANS_NODES_ENV] == "1"
        assert [len(owned[f"replica-{i}"][1]) for i in range(2)] == [2, 2], owned
        assert len(owned["train"][1]) == 1, owned
        assert owned["sync-0"][1] == owned["sync-1"][1] == [], owned  # zero-GPU actors: none
        _gpus_by_node(owned)
        # The replicas' announcements: the nodes' addresses, never loopback.
        deadline = time.monotonic() + 120
        announced: dict[str, str] = {}
        while time.monotonic() < deadline and len(announced) < 2:
            records = read_all(cfg.kafka, topics_config.name("replicas"), timeout_s=1)
            announced = {r.key.decode(): decode(r.value).address for r in records if r.value}
        assert sorted(announced) == ["replica-0", "replica-1"], announced
        assert not [a for a in announced.values() if is_loopback(a)], announced
        assert all(a == stages[name]["address"] for name, a in announced.items())
        # Broadcast weights: the trainer's rendezvous is announced at its node's address.
        broadcast = cfg.model_copy(
            update={"weights": cfg.weights.model_copy(update={"mode": "broadcast"})}
        )
        args = _trainer_address_args(broadcast, ray.get_actor(f"{run}/train"), 30)
        assert args[0] == "--set" and args[1].startswith("weights.host="), args
        assert not is_loopback(args[1].split("=", 1)[1]), args
        pids = [r["pid"] for r in rows]
    finally:
        down(two_gpu_nodes.address, run=run, grace_s=5)
    # `down`: no process of the run is left, vLLM's (the stubs, their engine children) too.
    import json

    stub_rows = [json.loads(p.read_text()) for p in stubs.glob("*.json")]
    assert len(stub_rows) == 2
    pids += [p for s in stub_rows for p in (s["pid"], s["core"])]
    left = [p for p in pids if Path(f"/proc/{p}").exists() and _alive(p)]
    for pid in left:
        os.kill(pid, 9)
    assert left == []

    # Three replicas of 2 take all six GPUs: the trainer (`auto`) gets none and is told so
    # with an empty CUDA_VISIBLE_DEVICES, not left to see its node's GPUs (the replicas').
    stubs_full = tmp_path / "stubs-full"
    stubs_full.mkdir()
    full = dict(common, extra_env={**stub_env, "STUB_VLLM_DIR": str(stubs_full)})
    try:
        rows = up(cfg, replicas=3, parallel=(2, 1, 1), **full)
        trainer = next(r for r in rows if r["stage"] == "train")
        assert _environ(trainer["pid"])[VISIBLE] == ""
        pids = [r["pid"] for r in rows]
    finally:
        down(two_gpu_nodes.address, run=run, grace_s=5)
    pids += [p for f in stubs_full.glob("*.json") for p in json.loads(f.read_text()).values()
             if isinstance(p, int)]  # fmt: skip
    left = [p for p in pids if Path(f"/proc/{p}").exists() and _alive(p)]
    assert left == []


def _alive(pid: int) -> bool:
    from pipeline.launch.foreground import running

    return running(pid)
