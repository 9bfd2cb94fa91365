"""Options declared on a dataclass: one default, one flag, read back by field name."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pipeline.cli.main import build_parser
from pipeline.cli.options import add_options, option, options_from
from pipeline.harness.chaos.run import ChaosOptions
from pipeline.harness.load.options import LoadOptions


@dataclass
class Opts:
    rounds: int = option(3, "Rounds.")
    share: float = option(0.5, "A share.", flag="--fraction")
    target: str | None = option(None, "Where to.", dest="where")
    cap: int | None = option(None, "At most.", type=int)
    internal: int = 7


def test_flags_carry_the_fields_defaults_and_types() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, Opts)
    assert options_from(parser.parse_args([]), Opts) == Opts()
    args = parser.parse_args(["--rounds", "5", "--fraction", "0.25", "--target", "x", "--cap", "2"])
    assert args.where == "x"  # the parser's own name for it, read back by the field's
    assert options_from(args, Opts, internal=1) == Opts(5, 0.25, "x", 2, 1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "many"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--internal", "1"])  # a field without `option` is no flag


@pytest.mark.parametrize(("command", "cls"), [(["chaos"], ChaosOptions), (["load"], LoadOptions)])
def test_a_commands_defaults_are_its_options_defaults(command: list[str], cls: type) -> None:
    assert options_from(build_parser().parse_args(command), cls) == cls()
