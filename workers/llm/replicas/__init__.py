"""Inference replicas, registered lazily by backend name.

    hf       transformers on CPU (`workers.llm.replicas.hf`): development, tests, demo
    vllm     vLLM on GPUs (`workers.llm.replicas.vllm`)

Importing this package imports nothing at all (no backend, no torch, no aiohttp, not even
`schemas`), so that a module of it can run where only its own imports are installed: vLLM's
worker processes import `workers.llm.replicas.vllm_worker` in vLLM's environment.
`get_backend(name)` imports the backend's module on first use, and a backend whose module or
libraries are missing raises `BackendUnavailableError` only when asked for, never at import.
Every backend module serves the HTTP contract of `workers.llm.contract` and exposes
`serve(model_dir, host, port, replica_id, version, ...)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["BACKENDS", "available_backends", "get_backend"]

BACKENDS: dict[str, str] = {
    "hf": "workers.llm.replicas.hf",
    "vllm": "workers.llm.replicas.vllm",
}


def get_backend(name: str) -> ModuleType:
    """The backend module for `name`, imported now; BackendUnavailableError if it cannot be."""
    from workers.llm.replicas.exceptions import BackendUnavailableError

    module = BACKENDS.get(name)
    if module is None:
        raise BackendUnavailableError(name, f"unknown backend; known: {sorted(BACKENDS)}")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(name, str(exc)) from exc


def available_backends() -> list[str]:
    """Names whose modules import here (imports each one; not for hot paths)."""
    from workers.llm.replicas.exceptions import BackendUnavailableError

    found = []
    for name in sorted(BACKENDS):
        try:
            get_backend(name)
        except BackendUnavailableError:
            continue
        found.append(name)
    return found
