"""`rollout config show`: resolved values with their sources; did-you-mean for a misspelt key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.cli.config import leaves, source_of
from pipeline.config import ConfigError, load_config, parse_overrides
from tests import ROOT


def show(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=60,
        check=False,
    )


def rows(done: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    assert done.returncode == 0, done.stderr
    return {k: (v, s) for k, v, s in (line.split("\t") for line in done.stdout.splitlines())}


def test_each_source_is_named(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  train_batch_size: 4\ntopics:\n  prefix: fromfile.\n")
    done = show(
        "--config", str(config), "config", "show", "--set", "trainer.max_staleness=3",
        "--bootstrap", "h:1", env={"ROLLOUT_TOPICS__PREFIX": "fromenv."},
    )  # fmt: skip
    got = rows(done)
    assert got["kafka.bootstrap_servers"] == ('["h:1"]', "flag")  # a global flag after the command
    assert got["trainer.max_staleness"] == ("3", "flag")
    assert got["topics.prefix"] == ('"fromenv."', "env")  # env over file
    assert got["trainer.train_batch_size"] == ("4", "file")
    assert got["replay.max_staleness"] == ("3", "derived")
    assert got["trainer.seed"][1] == "default"


def test_one_key_and_a_misspelt_one() -> None:
    assert set(rows(show("config", "show", "trainer.max_staleness"))) == {"trainer.max_staleness"}
    done = show("config", "show", "trainer.max_stalenes")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "rollout: no setting trainer.max_stalenes; did you mean trainer.max_staleness "
        "or trainer.max_steps?"
    )


def test_a_misspelt_setting_is_refused_with_the_closest_key() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.lrr: .*did you mean trainer\.lr\?") as caught:
        load_config(None, parse_overrides(["trainer.lrr=1e-5"]))
    assert "Extra inputs are not permitted" in str(caught.value)
    with pytest.raises(ConfigError, match=r"did you mean topics\.prefix\?"):
        load_config(None, parse_overrides(["topics.prefx=a."]))


def test_source_of_precedence_and_leaves() -> None:
    flags, file = {"a": {"b": 1}}, {"a": {"b": 2, "c": 3}}
    assert source_of("a.b", flags=flags, env={"ROLLOUT_A__B": "4"}, file=file) == "flag"
    assert source_of("a.c", flags=flags, env={"rollout_a__c": "4"}, file=file) == "env"
    assert source_of("a.c", flags=flags, env={"ROLLOUT_A": "{}"}, file=file) == "env"
    assert source_of("a.c", flags={}, env={}, file=file) == "file"
    assert source_of("a.d", flags={}, env={}, file=None) == "default"
    assert leaves({"a": {"b": 1, "c": {}}, "d": [1]}) == [("a.b", 1), ("a.c", {}), ("d", [1])]
