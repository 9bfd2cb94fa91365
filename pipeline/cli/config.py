"""`rollout config show [KEY]`: the resolved configuration, each value with where it came from.

Every leaf of the run's config (or those under KEY) is printed as `key<TAB>value<TAB>source`,
the value as JSON (secrets masked), the source one of: `flag` (`--set`, `--bootstrap`), `env`
(a `ROLLOUT_…` variable), `file` (the YAML file), `derived` (filled from another setting, see
`pipeline.config.DERIVED`) or `default`. The precedence is the loader's: flag over env over
file over default. A KEY that names nothing is one line with the closest keys that exist.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import DERIVED, ConfigError, RunConfig, closest_keys, parse_overrides

__all__ = ["add_parsers", "leaves", "source_of"]


def leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a dumped config; an empty mapping is a leaf."""
    if isinstance(data, dict) and data:
        return [pair for k, v in data.items() for pair in leaves(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), data)]


def source_of(
    key: str, *, flags: dict[str, Any], env: dict[str, str], file: dict[str, Any] | None
) -> str:
    """Where the loader took `key` from (see the module docstring)."""
    if key in DERIVED:
        return "derived"
    parts = key.split(".")
    if _given(flags, parts):
        return "flag"
    names = {k.upper() for k in env}
    for depth in range(len(parts), 0, -1):  # the key's own variable, or a JSON one above it
        if ("ROLLOUT_" + "__".join(parts[:depth])).upper() in names:
            return "env"
    if file is not None and _given(file, parts):
        return "file"
    return "default"


def _derived(cfg: RunConfig) -> list[tuple[str, Any]]:
    """The derived copies (left out of the dump so a written config loads again)."""
    out = []
    for key in DERIVED:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if hasattr(value, "model_dump"):  # a derived section (agent_loop.media): one JSON row
            value = value.model_dump(mode="json")
        out.append((key, value))
    return out


def _given(data: Any, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def cmd_config_show(args: argparse.Namespace, cfg: RunConfig) -> int:
    flags = parse_overrides(args.set or [])
    if args.bootstrap:
        flags.setdefault("kafka", {})["bootstrap_servers"] = args.bootstrap
    path = args.config or os.environ.get("ROLLOUT_CONFIG")
    file = yaml.safe_load(Path(path).read_text()) if path else None
    everything = sorted([*leaves(cfg.redacted()), *_derived(cfg)])
    rows = everything
    if args.key:
        rows = [(k, v) for k, v in rows if k == args.key or k.startswith(args.key + ".")]
        if not rows:
            known = [k for k, _ in everything]
            hint = closest_keys(args.key, known)
            raise ConfigError(
                f"no setting {args.key}" + (f"; did you mean {' or '.join(hint)}?" if hint else "")
            )
    for key, value in rows:
        source = source_of(key, flags=flags, env=dict(os.environ), file=file)
        print(f"{key}\t{json.dumps(value)}\t{source}")
    return 0


def add_parsers(sub: Any) -> None:
    config = sub.add_parser("config", help="The run's resolved configuration.")
    csub = config.add_subparsers(dest="action", required=True)
    show = csub.add_parser(
        "show", help="Each setting's resolved value and its source (flag, env, file, default)."
    )
    show.add_argument("key", nargs="?", help="One setting or section, e.g. trainer.max_staleness.")
    show.set_defaults(handler=cmd_config_show)
