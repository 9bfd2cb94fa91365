"""The configuration reference, generated from the config models: `docs/configuration.md`.

    python -m pipeline.config_doc            # rewrite docs/configuration.md
    python -m pipeline.config_doc --check    # exit 1 when the checked-in copy is out of date

Walks `RunConfig` and the stage models nested in it: one section per top-level field, one
table per section, nested models flattened into dotted keys (the same paths `--set` takes).
Each row gives the key, its environment variable, the type with its constraints, the default
and the field's description. A stage's copy of a shared setting (`exclude=True`, filled by
`RunConfig` from its source: `pipeline.config.DERIVED`) is no setting and has no row. The
output is a pure function of the models: defaults come from the models (never from the
environment or a config file), secrets are masked, and nothing depends on the machine or the
time, so a unit test can compare it with the checked-in copy.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from pipeline.config import RunConfig

__all__ = ["DOC_PATH", "Row", "main", "render", "rows"]

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
ENV_PREFIX = "ROLLOUT_"
ENV_DELIMITER = "__"
REGENERATE = "python -m pipeline.config_doc"


@dataclass(frozen=True)
class Row:
    """One configurable leaf (or optional nested model) of the run's config."""

    key: str
    env: str
    type: str
    default: str
    description: str


def rows(model: type[BaseModel], prefix: str = "", instance: Any = None) -> Iterator[Row]:
    """Every leaf of `model` as a `Row`, depth first, in declaration order.

    `instance` is the parent's default value: a nested model's defaults are read from it, so
    `topics.policy` shows its own defaults (compact, one partition), not `TopicSpec`'s.
    """
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        key = f"{prefix}{name}"
        if isinstance(instance, BaseModel):
            default: Any = getattr(instance, name)
        elif field.is_required():
            default = _REQUIRED
        else:
            default = field.get_default(call_default_factory=True)
        nested = _nested_model(field.annotation)
        if nested is None or _is_optional(field.annotation):
            yield Row(
                key=key,
                env=env_name(key),
                type=_describe_type(field),
                default=_format_default(default),
                description=_description(field, nested),
            )
        if nested is not None:
            yield from rows(nested, f"{key}.", default)


def env_name(key: str) -> str:
    """`agent_loop.sampling.max_tokens` → `ROLLOUT_AGENT_LOOP__SAMPLING__MAX_TOKENS`."""
    return ENV_PREFIX + ENV_DELIMITER.join(part.upper() for part in key.split("."))


def render() -> str:
    """The whole reference as Markdown."""
    sections = list(RunConfig.model_fields)
    out = [
        "# Configuration reference",
        "",
        f"Generated from the config models by `{REGENERATE}`; do not edit by hand",
        "(`tests/unit/pipeline/test_config_doc.py` fails when this file is out of date).",
        "",
        "One run is configured by one `RunConfig`: a YAML file (`--config FILE` or",
        "`$ROLLOUT_CONFIG`), environment variables, and command-line flags. Precedence, highest",
        "first:",
        "",
        "1. flags: `--set key.path=value` (repeat; the value is read as YAML) and the named",
        "   flags of a command (`--bootstrap`, `--model`, `--replica`, …);",
        f"2. environment: `{ENV_PREFIX}<SECTION>{ENV_DELIMITER}<FIELD>`, with "
        f"`{ENV_DELIMITER}` between every level",
        "   (the column *env* below); lists and mappings are JSON there, e.g.",
        "   `ROLLOUT_AGENT_LOOP__REPLICAS='[\"http://replica-0:8000\"]'`, and",
        "   `ROLLOUT_KAFKA__BOOTSTRAP_SERVERS` also takes `host1:9092,host2:9092`;",
        "3. the YAML file;",
        "4. the defaults below.",
        "",
        "Unknown keys are errors, and a wrong value fails at start with the field named.",
        "Secrets (`SecretStr`) are masked here, in logs and in the resolved config written next",
        "to a run's outputs; pass them by environment, never in the file.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name in sections) + ".",
    ]
    for name, field in RunConfig.model_fields.items():
        model = _nested_model(field.annotation)
        assert model is not None, f"RunConfig.{name} is not a model"
        out += ["", f"## {name}", ""]
        doc = inspect.getdoc(model)
        if doc:
            out += [_one_paragraph(doc), ""]
        out += [
            "| key | env | type | default | description |",
            "|---|---|---|---|---|",
        ]
        default = field.get_default(call_default_factory=True)
        for row in rows(model, f"{name}.", default):
            cells = (f"`{row.key}`", f"`{row.env}`", row.type, row.default, row.description)
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


# --- pieces ---------------------------------------------------------------------------


class _Required:
    def __repr__(self) -> str:
        return "required"


_REQUIRED = _Required()


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    # The model itself, or `Model | None`; never a model inside a list or dict.
    union = get_origin(annotation) in (Union, types.UnionType)
    for candidate in get_args(annotation) if union else (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is Annotated:
        return _type_name(args[0])
    if annotation is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join(_type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


_BOUNDS = (
    (annotated_types.Gt, "gt", "> {}"),
    (annotated_types.Ge, "ge", "≥ {}"),
    (annotated_types.Lt, "lt", "< {}"),
    (annotated_types.Le, "le", "≤ {}"),
    (annotated_types.MinLen, "min_length", "length ≥ {}"),
    (annotated_types.MaxLen, "max_length", "length ≤ {}"),
)


def _constraints(field: FieldInfo) -> list[str]:
    found: list[str] = []
    for item in field.metadata:
        for kind, attr, template in _BOUNDS:
            if isinstance(item, kind):
                found.append(template.format(getattr(item, attr)))
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            found.append(f"matches `{pattern}`")
    return found


def _describe_type(field: FieldInfo) -> str:
    text = f"`{_type_name(field.annotation)}`"
    bounds = _constraints(field)
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _format_default(value: Any) -> str:
    if value is _REQUIRED:
        return "required"
    if isinstance(value, SecretStr):
        return "`**********`"
    return f"`{json.dumps(to_jsonable_python(value), ensure_ascii=False)}`"


def _description(field: FieldInfo, nested: type[BaseModel] | None) -> str:
    if field.description:
        return field.description
    if nested is not None and nested.__doc__:
        return _one_paragraph(inspect.getdoc(nested) or "")
    return ""


def _one_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.config_doc",
        description="Write the configuration reference generated from the config models.",
    )
    parser.add_argument("--out", type=Path, default=DOC_PATH, help=f"Default: {DOC_PATH}.")
    parser.add_argument(
        "--check", action="store_true", help="Write nothing; exit 1 if --out is out of date."
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            print(f"{args.out} is out of date; regenerate with: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
