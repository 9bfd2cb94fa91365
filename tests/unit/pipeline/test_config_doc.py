"""docs/configuration.md is generated from the config models and must match them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from pipeline import config_doc
from pipeline.config import load_config

REGENERATE = ".venv/bin/python -m pipeline.config_doc"


def test_checked_in_reference_is_up_to_date() -> None:
    current = config_doc.DOC_PATH.read_text(encoding="utf-8")
    assert current == config_doc.render(), (
        f"{config_doc.DOC_PATH} is out of date with the config models; "
        f"regenerate it with `{REGENERATE}` and commit it"
    )


def test_every_leaf_is_described() -> None:
    missing = [row.key for row in config_doc.rows(config_doc.RunConfig) if not row.description]
    assert not missing, f"give these fields a Field(description=...): {missing}"


def test_nested_defaults_come_from_the_parent_default() -> None:
    rows = {row.key: row for row in config_doc.rows(config_doc.RunConfig)}
    assert rows["topics.policy.cleanup_policy"].default == '`"compact"`'
    assert rows["topics.turns.cleanup_policy"].default == '`"delete"`'
    assert rows["reward.custom"].default == "`null`"
    assert rows["reward.custom.path"].default == "required"


def test_secret_defaults_are_masked() -> None:
    assert config_doc._format_default(SecretStr("hunter2")) == "`**********`"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("agent_loop.sampling.max_tokens", "100", 100),
        ("topics.turns.partitions", "7", 7),
        ("trainer.checkpoint_dir", "/data/checkpoints", "/data/checkpoints"),
    ],
)
def test_env_names_are_the_ones_the_config_reads(
    monkeypatch: pytest.MonkeyPatch, key: str, value: str, expected: object
) -> None:
    monkeypatch.delenv("ROLLOUT_CONFIG", raising=False)
    monkeypatch.setenv(config_doc.env_name(key), value)
    node: object = load_config()
    for part in key.split("."):
        node = getattr(node, part)
    assert node == expected


def test_check_mode_reports_how_to_regenerate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert config_doc.main(["--check", "--out", str(stale)]) == 1
    assert "python -m pipeline.config_doc" in capsys.readouterr().err
    assert config_doc.main(["--out", str(stale)]) == 0
    assert config_doc.main(["--check", "--out", str(stale)]) == 0
