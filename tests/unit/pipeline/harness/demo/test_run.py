"""The demo's configuration per preset: the MoE preset trains with routing replay (r3), the
dense one without; `--preset` reaches the recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import RunConfig
from pipeline.harness.demo.run import main
from pipeline.harness.recipe import DemoRecipe
from pipeline.harness.recipe_run import recipe_config


@pytest.mark.parametrize(("preset", "replay"), [("tiny", "off"), ("moe", "r3")])
def test_the_moe_preset_trains_with_router_replay(tmp_path: Path, preset: str, replay: str) -> None:
    cfg = recipe_config(
        RunConfig(), prefix="demo-x.", run_dir=tmp_path, recipe=DemoRecipe(preset=preset)
    )
    assert cfg.trainer.router_replay == replay
    assert cfg.trainer.model_dir == str(tmp_path / "model")


def test_an_unknown_preset_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--preset", "huge"])
    assert exc.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err
