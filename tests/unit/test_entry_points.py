"""Every `python -m MODULE` of the project that its files name (Makefile, README, docs, infra,
code) can run: a module with a `__main__` block, or a package with a `__main__` module. A move
that leaves `make demo` pointing at a package with no `__main__.py` fails here, not in a demo."""

from __future__ import annotations

import importlib.util
import re

from tests import ROOT

NAMED = re.compile(r"-m ((?:pipeline|workers|schemas)(?:\.\w+)*)")
WHERE = ["Makefile", "README.md", "Dockerfile", "docker-compose.yml", "docs", "infra"]
CODE = ["pipeline", "workers", "schemas", "tests", "examples"]


def named_modules() -> set[str]:
    files = [ROOT / name for name in WHERE if (ROOT / name).is_file()]
    for folder in [*WHERE, *CODE]:
        if (ROOT / folder).is_dir():
            files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".sh"}]
    return {m for path in files for m in NAMED.findall(path.read_text(errors="replace"))}


def test_every_named_module_entry_point_runs() -> None:
    named = named_modules()
    assert "pipeline.harness.demo" in named and "pipeline.cli.main" in named
    broken = []
    for module in sorted(named):
        spec = importlib.util.find_spec(module)
        if spec is None:
            broken.append(f"{module}: no such module")
        elif spec.submodule_search_locations is not None:
            if importlib.util.find_spec(module + ".__main__") is None:
                broken.append(f"{module}: a package without __main__.py")
        elif "__main__" not in (spec.loader.get_source(module) or ""):  # type: ignore[union-attr]
            broken.append(f"{module}: no __main__ block")
    assert not broken, "\n".join(broken)
