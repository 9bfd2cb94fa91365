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


def test_every_command_group_lists_its_verbs_each_with_a_line() -> None:
    """`rollout GROUP --help` lists every verb with one line of help (`topics` too, which took
    its action as a positional argument)."""
    import argparse

    from pipeline.cli.main import build_parser

    def groups(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield path, action
                for name, child in action.choices.items():
                    yield from groups(child, (*path, name))

    found = dict(groups(build_parser(), ()))
    assert ("topics",) in found and ("kafka",) in found
    for path, action in found.items():
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for verb in action.choices:
            assert helps.get(verb), f"`rollout {' '.join((*path, verb))}` has no help line"
    args = build_parser().parse_args(["topics", "create"])
    assert args.action == "create"
