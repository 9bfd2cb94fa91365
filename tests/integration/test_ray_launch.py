"""`rollout up --ray ADDRESS` runs the whole pipeline as Ray actors, `rollout down` stops it.

A Ray instance of this test's own (started in the test process, so it dies with it and no
other Ray instance on the machine is touched), the real broker, the tiny model on CPU: the
trainer (`trainer.nproc: 2`, so its actor drives one actor per rank, `pipeline.launch.ray.trainer`)
publishes its versions, the replicas load them, then nothing of the run is left.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.data.arithmetic import arithmetic_rows
from pipeline.data.producer import PromptProducer
from schemas import decode
from tests.conftest import run_cli
from tests.integration.test_pipeline_e2e import BATCH, STEPS, pipeline_config
from tests.integration.trainer_helpers import policy_versions, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.long]

NAMESPACE = "rollout-pipeline"
REPLICAS = 2


@pytest.fixture
def ray_address():
    ray = pytest.importorskip("ray")
    ctx = ray.init(
        address="local",  # a new instance, never one that already runs here
        num_cpus=4,  # the run asks for 4: two hf replicas and two trainer ranks
        include_dashboard=False,
        object_store_memory=80 * 1024**2,
        log_to_driver=False,
    )
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


def run_actors(run: str) -> list[str]:
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(run + "/")
    )


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def processes_of(pids: set[int], marker: str | None = None) -> list[str]:
    """Live processes in the process groups of `pids`, or whose command line has `marker`."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgid = fields[0], int(fields[2])
        if state != "Z" and (pgid in pids or (marker is not None and marker in cmdline)):
            left.append(f"{entry.name}: {cmdline[:200]}")
    return left


def test_up_runs_the_pipeline_as_ray_actors_and_down_leaves_nothing(
    ray_address, kafka_config, kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    run = topics_config.prefix.rstrip(".")
    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    config_file = tmp_path / "pipeline.yaml"
    data = cfg.redacted()
    data["trainer"]["nproc"] = 2
    config_file.write_text(yaml.safe_dump(data, sort_keys=False))
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(24, seed=7), uid_prefix="ray")
    run_dir = tmp_path / "run"

    up = run_cli(
        "--config",
        str(config_file),
        "up",
        "--ray",
        ray_address,
        "--run",
        run,
        "--model",
        str(tiny_model),
        "--run-dir",
        str(run_dir),
        "--replicas",
        str(REPLICAS),
        "--steps",
        str(STEPS),
        "--wait",
        "--timeout",
        "240",
        timeout=330,
    )
    try:
        rows = [json.loads(line) for line in up.stdout.splitlines() if line.startswith("{")]
        logs = {p.name: p.read_text()[-1500:] for p in (run_dir / "logs").glob("*.log")}
        assert up.returncode == 0, (up.stderr[-3000:], logs)
        stages = {r["stage"]: r for r in rows}
        assert sorted(stages) == sorted(
            ["agent-loop", "reward", "replay", "train"]
            + [f"{kind}-{i}" for i in range(REPLICAS) for kind in ("replica", "sync")]
        )
        assert run_actors(run) == sorted(f"{run}/{name}" for name in stages)
        assert (run_dir / "config.yaml").is_file()

        # The trainer's actor drove two rank actors (their logs), which wrote a shard each.
        ckpt = Path(cfg.trainer.checkpoint_dir)
        ranks = sorted(p.name for p in (ckpt / "logs").glob("train-rank-*.log"))
        assert ranks == ["train-rank-0.log", "train-rank-1.log"]
        assert len(list((ckpt / "sharded" / f"step-{STEPS}").glob("*.distcp"))) == 2
        # The trainer published every version; trajectories went through scored and replay.
        versions = policy_versions(kafka_config, topics_config.name("policy"))
        assert [v.version for v in versions][-STEPS:] == list(range(1, STEPS + 1))
        assert len(read_all(kafka_config, topics_config.name("scored"), timeout_s=2)) >= 2 * BATCH
        assert len(read_all(kafka_config, topics_config.name("replay"), timeout_s=2)) >= BATCH
        # Each replica, reached at the node address it advertised, loaded the last version.
        for i in range(REPLICAS):
            address = stages[f"replica-{i}"]["address"]
            assert address.startswith(f"http://{node_ip()}:"), address
            for _ in range(30):
                with urllib.request.urlopen(address + "/health", timeout=5) as resp:
                    if json.loads(resp.read())["version"] == STEPS:
                        break
                time.sleep(1.0)
            else:
                pytest.fail(f"replica-{i} never loaded version {STEPS}")

        # An actor that dies takes its process along (PDEATHSIG): nothing is orphaned.
        import ray

        ray.kill(ray.get_actor(f"{run}/sync-0", namespace=NAMESPACE), no_restart=True)
        deadline = time.monotonic() + 30
        while processes_of({stages["sync-0"]["pid"]}) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_of({stages["sync-0"]["pid"]}) == []
    finally:
        down = run_cli("down", "--ray", ray_address, "--run", run, "--grace", "20", timeout=120)

    assert down.returncode == 0, down.stderr[-3000:]
    stopped = sorted(line.split("\t")[0] for line in down.stdout.splitlines())
    assert stopped == sorted(f"{run}/{name}" for name in stages if name != "sync-0"), down.stdout
    assert run_actors(run) == []
    pids = {r["pid"] for r in rows}
    assert processes_of(pids, str(run_dir / "config.yaml")) == []


@pytest.mark.timeout(600)  # with the judge's warm start when it comes first (test_judge.py)
def test_up_places_the_judge_pool_in_the_trainers_bundle_and_down_removes_it(
    ray_address, kafka_config, kafka_bootstrap, topics_config, tiny_model, judge_model, tmp_path
) -> None:
    """`reward.judge` on: `judge-0` (role judge, no sync) shares the trainer's placement group,
    scores every trajectory, and keeps version 0 while the policy replica loads each one."""
    import ray

    from tests.integration.test_judge import judge_settings

    run = topics_config.prefix.rstrip(".")
    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    data = cfg.redacted()
    data["trainer"]["max_steps"] = 2
    data["reward"]["judge"] = judge_settings(judge_model)
    config_file = tmp_path / "pipeline.yaml"
    config_file.write_text(yaml.safe_dump(data, sort_keys=False))
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(24, seed=9, max_operand=3), uid_prefix="judge")
    run_dir = tmp_path / "run"
    up = run_cli("--config", str(config_file), "up", "--ray", ray_address, "--run", run,
                 "--model", str(tiny_model), "--run-dir", str(run_dir), "--replicas", "1",
                 "--wait", "--timeout", "300", timeout=400)  # fmt: skip
    try:
        lines = [line for line in up.stdout.splitlines() if line.startswith("{")]
        rows = {r["stage"]: r for r in map(json.loads, lines)}
        logs = {p.name: p.read_text()[-1500:] for p in (run_dir / "logs").glob("*.log")}
        assert up.returncode == 0, (up.stderr[-3000:], logs)
        assert sorted(rows) == sorted(
            ["agent-loop", "reward", "replay", "train", "replica-0", "sync-0", "judge-0"]
        )
        where = {
            name: ray.get(ray.get_actor(f"{run}/{name}", namespace=NAMESPACE).where.remote())
            for name in ("train", "judge-0", "replica-0")
        }
        assert where["judge-0"]["placement_group"] is not None
        assert where["judge-0"]["placement_group"] == where["train"]["placement_group"]
        assert where["replica-0"]["placement_group"] is None
        judge, policy = rows["judge-0"]["address"], rows["replica-0"]["address"]
        with urllib.request.urlopen(judge + "/health", timeout=5) as resp:
            assert json.loads(resp.read())["version"] == 0  # no weight update reached it
        for _ in range(30):
            with urllib.request.urlopen(policy + "/health", timeout=5) as resp:
                if json.loads(resp.read())["version"] == 2:
                    break
            time.sleep(1.0)
        else:
            pytest.fail("the policy replica never loaded version 2")
        scored = read_all(kafka_config, topics_config.name("scored"), timeout_s=2)
        assert scored
        for record in scored:
            extra = decode(record.value).reward_extra
            assert extra.get("scorer") == "judge" or extra["reward_failed"], extra
    finally:
        down = run_cli("down", "--ray", ray_address, "--run", run, "--grace", "20", timeout=120)

    assert down.returncode == 0, down.stderr[-3000:]
    assert run_actors(run) == []
    groups = [g for g in ray.util.placement_group_table().values() if g["name"] == f"{run}/trainer"]
    assert groups and all(g["state"] == "REMOVED" for g in groups), groups


def test_up_hybrid_lends_the_trainer_from_its_actor(
    ray_address, kafka_config, kafka_bootstrap, topics_config, tiny_model, tmp_path
) -> None:
    """`trainer.lend` on (the hybrid mode): the trainer's actor's process serves generation at
    the node's address between its steps and withdraws before each (its step log says so).
    Synchronous (`max_staleness` 0), so the next batch is not already waiting when the trainer
    has stepped: with groups ready it would rightly decline to lend (`declined`)."""
    run = topics_config.prefix.rstrip(".")
    cfg = pipeline_config(kafka_bootstrap, topics_config.prefix, tiny_model, tmp_path, 1)
    data = cfg.redacted()
    data["trainer"].update(
        max_steps=2, max_staleness=0, lend={"enable": True, "reclaim_ratio": 0.5}
    )
    config_file = tmp_path / "pipeline.yaml"
    config_file.write_text(yaml.safe_dump(data, sort_keys=False))
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(24, seed=11), uid_prefix="hybrid")
    run_dir = tmp_path / "run"
    up = run_cli("--config", str(config_file), "up", "--ray", ray_address, "--run", run,
                 "--model", str(tiny_model), "--run-dir", str(run_dir), "--replicas", "1",
                 "--wait", "--timeout", "300", timeout=400)  # fmt: skip
    try:
        logs = {p.name: p.read_text()[-1500:] for p in (run_dir / "logs").glob("*.log")}
        assert up.returncode == 0, (up.stderr[-3000:], logs)
        metrics = Path(cfg.trainer.checkpoint_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        lends = [r for r in rows if r["event"] == "lend"]
        assert [r["step"] for r in lends] == [1, 2]
        for record in lends:  # each collection lent or declined; withdrawn before each step
            assert record["lends"] + record["declined"] >= record["step"], record
            assert record["withdrawals"] == record["lends"], record
            assert record["tokens_during_steps"] == record["running_at_steps"] == 0, record
        assert lends[-1]["lends"] >= 1, lends  # lent after step 1, before publishing
        # Announced at the node's address on rl.replicas, and withdrawn (a tombstone) last.
        lent = [
            r
            for r in read_all(kafka_config, topics_config.name("replicas"), timeout_s=2)
            if r.key.decode().startswith("trainer-lent-")
        ]
        assert lent and lent[-1].value is None, lent
        infos = [decode(r.value) for r in lent if r.value is not None]
        assert infos and all(i.address.startswith(f"http://{node_ip()}:") for i in infos)
    finally:
        down = run_cli("down", "--ray", ray_address, "--run", run, "--grace", "20", timeout=120)
    assert down.returncode == 0, down.stderr[-3000:]
    assert run_actors(run) == []
