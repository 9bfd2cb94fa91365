"""Command-line options declared once, on the options dataclass a command runs with.

A field made with `option(default, help)` is also a flag (`--name-with-dashes` unless
`flag=` names another): `add_options` adds it to a parser, with the field's default and a
type read from the default (or `type=`), and `options_from` builds the dataclass from the
parsed namespace. Fields without `option` are set by the code, never by a flag. So a
command's defaults live in one place and a new option is one line.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

__all__ = ["add_flag", "add_options", "option", "options_from"]

T = TypeVar("T")


def option(default: Any, help: str, *, flag: str | None = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a command-line flag (`argparse_kwargs`: `type`, `dest`…)."""
    meta = {"help": help, "flag": flag, **argparse_kwargs}
    return dataclasses.field(default=default, metadata={"cli": meta})


def _flags(cls: type) -> list[tuple[dataclasses.Field[Any], dict[str, Any]]]:
    return [(f, dict(f.metadata["cli"])) for f in dataclasses.fields(cls) if "cli" in f.metadata]


def add_flag(
    parser: argparse.ArgumentParser,
    name: str,
    default: Any,
    help: str | None = None,
    *,
    flag: str | None = None,
    **argparse_kwargs: Any,
) -> None:
    """One flag read back as `name` (`--name-with-dashes` unless `flag=`), of `default`'s type
    (str for None) unless `type=` says otherwise."""
    flag = flag or "--" + name.replace("_", "-")
    argparse_kwargs.setdefault("dest", name)
    if "action" not in argparse_kwargs:
        argparse_kwargs.setdefault("type", str if default is None else type(default))
        argparse_kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        argparse_kwargs["default"] = default
    parser.add_argument(flag, help=help, **argparse_kwargs)


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add a flag to `parser` for each `option` field of the dataclass `cls`."""
    for f, meta in _flags(cls):
        add_flag(parser, f.name, f.default, meta.pop("help"), **meta)


def options_from(args: argparse.Namespace, cls: type[T], **given: Any) -> T:
    """`cls` with every `option` field read from `args` (`given`: the other fields)."""
    values = {f.name: getattr(args, meta.get("dest", f.name)) for f, meta in _flags(cls)}
    return cls(**{**values, **given})
