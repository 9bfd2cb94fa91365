"""No pickle, eval/exec or unsafe YAML anywhere in the project's code (checked on the AST)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "pipeline", "workers")
BANNED_MODULES = {"pickle", "cloudpickle", "dill", "marshal", "shelve"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}


def unsafe(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                f"import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES
            ]
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES
        ):
            found.append(f"from {node.module} import …")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in BANNED_CALLS:
                found.append(f"{func.id}()")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                owner, name = func.value.id, func.attr
                if owner == "yaml" and name in {"load", "unsafe_load", "full_load"}:
                    found.append(f"yaml.{name}()")
                if owner == "torch" and name == "load":
                    safe = any(
                        k.arg == "weights_only" and getattr(k.value, "value", None) is True
                        for k in node.keywords
                    )
                    if not safe:
                        found.append("torch.load() without weights_only=True")
    return found


def test_no_unsafe_deserialisation_in_the_code() -> None:
    hits = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            hits += [f"{path.relative_to(ROOT)}: {what}" for what in unsafe(path.read_text())]
    assert hits == [], "\n".join(hits)


def test_the_check_itself_catches_what_it_should() -> None:
    for bad in (
        "import pickle",
        "from cloudpickle import loads",
        "eval(text)",
        "yaml.load(s)",
        "torch.load(f)",
        "exec(code)",
        "torch.load(f, weights_only=False)",
    ):
        assert unsafe(bad), bad
    for fine in (
        "yaml.safe_load(s)",
        "model.eval()",
        "torch.load(f, weights_only=True)",
        "ast.literal_eval(s)",
        "x = 'no pickle here'",
    ):
        assert not unsafe(fine), fine
