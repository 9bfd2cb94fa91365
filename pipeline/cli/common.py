"""What every `rollout` command shares: one-line errors, JSON output, argparse types, and the
checks that turn a user's wrong path into one line before any work starts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, RunConfig

__all__ = [
    "Handler",
    "at_least",
    "checked_model_dir",
    "failed",
    "port",
    "print_json",
    "writable_dir",
]

#: A command: its parsed arguments and the run's resolved config in, an exit status out.
Handler = Callable[[argparse.Namespace, RunConfig], int]


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data) + "\n")


def failed(message: str, status: int = 1) -> int:
    """Say `rollout: error: message` on stderr (one line, no traceback); return `status`."""
    print(f"rollout: error: {message}", file=sys.stderr)
    return status


def port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535 (a usage line, not a traceback, otherwise)."""
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port (1-65535): {text}")
    return value


def at_least(
    low: float, kind: Callable[[str], Any], *, strict: bool = False
) -> Callable[[str], Any]:
    """An argparse type: `kind(text)`, refused (one usage line) below `low`, or at it if strict."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}: {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def writable_dir(path: Path, what: str) -> None:
    """Create `path` (and its parents) now, so an output the user cannot write is one line
    before the work, not an OSError traceback after it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create directory {path}: {exc.strerror or exc}") from exc


def checked_model_dir(path: str, what: str) -> str:
    """`path` if it is a model or tokenizer directory; else `ConfigError` naming `what` (the
    flag or field) and the command that writes one. Checked before any stage starts, so a
    typo is one line, not a transformers traceback after the imports."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        why = "is not a directory" if directory.exists() else "does not exist"
    elif not any((directory / name).is_file() for name in _MODEL_FILES):
        why = f"holds no {' or '.join(_MODEL_FILES)}"
    else:
        return str(directory)
    raise ConfigError(
        f"{what}: model directory {path} {why} "
        "(`rollout model init --out DIR` writes the project's tiny model)"
    )


_MODEL_FILES = ("config.json", "tokenizer_config.json")
