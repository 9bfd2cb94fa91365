"""`import_object("pkg.mod:attr")`: the one way config names code to load.

Agent loops, tools and custom reward functions are named in config by import path,
`package.module:name` (or `package.module.name`); `name` may be dotted (`Class.method`).
Nothing is imported but the module the path names. A path that is not of that form, a module
that does not import, or a missing attribute raises `ImportError` / `AttributeError`; each
caller wraps those in its own stage's error with the path in the message.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_object"]


def import_object(path: str) -> Any:
    """`pkg.mod:attr` or `pkg.mod.attr` → the object; `ImportError`/`AttributeError` if not."""
    if ":" in path:
        module_name, _, attribute = path.partition(":")
    else:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ImportError(f"{path!r} is not of the form 'package.module:name'")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj
