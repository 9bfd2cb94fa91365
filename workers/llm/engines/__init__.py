"""Inference engines behind the replica contract, one folder each, registered lazily by name.

    hf       transformers on CPU (`hf/`, served by `hf/server.py`): development, tests, demo
    vllm     vLLM on GPUs (`vllm/`, `vllm/server.py`)
    sglang   SGLang on GPUs (`sglang/`, `sglang/server.py`): gated, not in `BACKENDS`; offered
             only where the interpreter chosen for it finds the `sglang` package
             (`--sglang-python`, else .venv-sglang's, else this one). Not yet proven against a
             running SGLang (README "SGLang": it does not run on the development CPUs).

Beside them, once, what the engines behind an adapter share: the gate in front of the server
(`gate.py`: the contract, pause/abort/drain, weight updates, status), its HTTP client
(`upstream.py`), the child-process launcher (`child_server.py`), the served configuration
(`served_config.py`), a replica's presence on the replicas topic (`registration.py`) and the
errors (`exceptions.py`).

Importing this package imports nothing at all (no backend, no torch, no aiohttp, not even
`schemas`), so that a module of it can run where only its own imports are installed: vLLM's
worker processes import `workers.weights.vllm_worker` in vLLM's environment.
`get_backend(name)` imports the backend's module on first use, and a backend whose module or
libraries are missing raises `BackendUnavailableError` only when asked for, never at import.
Every backend module serves the HTTP contract of `workers.llm.contract` and exposes
`serve(model_dir, host, port, replica_id, version, ...)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "BACKENDS",
    "GATED_BACKENDS",
    "available_backends",
    "backend_names",
    "get_backend",
]

BACKENDS: dict[str, str] = {
    "hf": "workers.llm.engines.hf.server",
    "vllm": "workers.llm.engines.vllm.server",
}


#: Backends offered only where their engine's package is found, by the interpreter chosen for
#: it: name -> module, whose `check_engine(python)` is the gate (BackendUnavailableError).
GATED_BACKENDS: dict[str, str] = {
    "sglang": "workers.llm.engines.sglang.server",
}


def backend_names() -> list[str]:
    """Every name `get_backend` may accept (the gated ones still pass their gate first)."""
    return sorted({*BACKENDS, *GATED_BACKENDS})


def get_backend(name: str, *, python: str | None = None) -> ModuleType:
    """The backend module for `name`, imported now; BackendUnavailableError if it cannot be,
    or if `name` is gated and its engine's package is not found by `python` (None: the
    backend's default interpreter)."""
    from workers.llm.engines.exceptions import BackendUnavailableError

    module = BACKENDS.get(name) or GATED_BACKENDS.get(name)
    if module is None:
        raise BackendUnavailableError(name, f"unknown backend; known: {backend_names()}")
    try:
        loaded = importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(name, str(exc)) from exc
    if name in GATED_BACKENDS:
        loaded.check_engine(python)
    return loaded


def available_backends() -> list[str]:
    """Names offered here: those whose modules import, and the gated ones whose engine's
    package their default interpreter finds (imports each one; not for hot paths)."""
    from workers.llm.engines.exceptions import BackendUnavailableError

    found = []
    for name in backend_names():
        try:
            get_backend(name)
        except BackendUnavailableError:
            continue
        found.append(name)
    return found
