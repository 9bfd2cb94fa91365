"""The scrape config's one source: the checked-in file is its output, every process of a
plan has a job, and the local rendering scrapes exactly the ports it is given."""

from __future__ import annotations

import pytest
import yaml

from pipeline.launch.local import StagePlan
from pipeline.observe.scrape import JOBS, compose_config, job_of, local_config
from tests import ROOT

PROMETHEUS = ROOT / "infra" / "prometheus" / "prometheus.yml"


def test_the_checked_in_config_is_the_sources_output() -> None:
    assert PROMETHEUS.read_text() == compose_config(), (
        "regenerate it: python -m pipeline.observe.scrape > infra/prometheus/prometheus.yml"
    )


def test_every_process_of_a_plan_has_exactly_one_job() -> None:
    plan = StagePlan(model_dir="/m", agent_loop_workers=3).processes([8001, 8002])
    jobs = {name: job_of(name) for name, _ in plan}
    for name in jobs:
        assert sum(bool(p.fullmatch(name)) for p in JOBS.values()) == 1, name
    assert set(jobs.values()) == set(JOBS)
    assert jobs["train"] == "trainer" and jobs["agent-loop-2"] == "agent-loop"
    with pytest.raises(ValueError, match="no scrape job"):
        job_of("trainer-0")


def test_local_config_scrapes_the_ports_it_is_given() -> None:
    config = yaml.safe_load(
        local_config(
            {"agent-loop": 9001, "train": 9002, "sync-0": 9003},
            {"replica-0": 8001},
            scrape_interval_s=1,
        )
    )
    assert config["global"]["scrape_interval"] == "1s"
    targets = {
        job["job_name"]: [(s["targets"], s["labels"]["process"]) for s in job["static_configs"]]
        for job in config["scrape_configs"]
    }
    assert targets == {
        "agent-loop": [(["127.0.0.1:9001"], "agent-loop")],
        "trainer": [(["127.0.0.1:9002"], "train")],
        "sync": [(["127.0.0.1:9003"], "sync-0")],
        "replicas": [(["127.0.0.1:8001"], "replica-0")],
    }
