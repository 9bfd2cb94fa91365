"""The one parser: global flags before or after the command, every flag with its help."""

from __future__ import annotations

import argparse

from pipeline.cli.main import _commands, _merge_late, build_parser


def parse(*argv: str) -> argparse.Namespace:
    return _merge_late(build_parser().parse_args(list(argv)))


def test_global_flags_after_the_command_count_as_before_it() -> None:
    args = parse("produce", "--dataset", "d.jsonl", "--bootstrap", "h:1", "--set", "a=1", "-v")
    assert (args.bootstrap, args.set, args.verbose) == ("h:1", ["a=1"], 1)
    args = parse("--set", "a=1", "--bootstrap", "h:1", "topics", "create", "--set", "b=2")
    assert args.set == ["a=1", "b=2"] and args.bootstrap == "h:1"
    args = parse("--config", "x.yaml", "status", "--config", "y.yaml", "-vv")
    assert args.config == "y.yaml" and args.verbose == 2
    args = parse("status")
    assert (args.config, args.set, args.bootstrap, args.verbose) == (None, None, None, 0)


def test_every_flag_of_every_command_says_what_it_is_for() -> None:
    missing = []
    for command in _commands(build_parser()):
        for action in command._actions:
            if action.option_strings and not action.help and action.dest != "help":
                missing.append(f"{command.prog} {'/'.join(action.option_strings)}")
    assert not missing, "flags without help:\n" + "\n".join(missing)
