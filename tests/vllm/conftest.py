"""Fixtures of the `vllm` tests: real vLLM replicas on CPU, started once per session.

These tests need `.venv-vllm` (`make vllm`; `make test-vllm` builds it first). Without it they
fail with that instruction rather than skip: a run that asked for them must not pass empty.

- `checkpoints`: three tied and three untied versions of the tiny model (`support.py`).
- `tied_replica` / `untied_replica`: `rollout replica serve --backend vllm` of version 0,
  one of each for the whole session (a start costs 1-2 minutes on two shared cores). The
  untied one runs with `--max-num-seqs UNTIED_MAX_NUM_SEQS`, so test_load.py can fill it
  instead of starting a replica of its own.
- Order: tests that ask for `untied_replica` by name (test_load.py) run last, after
  test_weight_sync.py has started it, so it is not alive beside the two-replica tests
  (test_loop.py, test_weight_broadcast.py): each replica holds about 4 GB.
- `replica_url`: overrides tests/gpu/test_replica_contract.py's, so the contract tests that
  tests/vllm/test_contract.py collects run against `tied_replica`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.vllm.support import UNTIED_MAX_NUM_SEQS, VLLM_PYTHON, Replica, make_checkpoints


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the tests that ask for `untied_replica` by name to the end (see the docstring)."""
    items.sort(key=lambda item: "untied_replica" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} missing: build it with `make vllm`", pytrace=False)
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "tied": make_checkpoints(root, tied=True, count=3),
        "untied": make_checkpoints(root, tied=False, count=3),
    }


def _serve(
    kind: str, checkpoints: dict[str, list[Path]], logs: Path, *extra: str
) -> Iterator[Replica]:
    port = free_port()
    with Replica(checkpoints[kind][0], port, logs / f"replica-{kind}.log", *extra) as replica:
        yield replica


@pytest.fixture(scope="session")
def replica_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where replica logs go: $ROLLOUT_VLLM_TEST_LOGS (CI keeps them) or a temporary folder."""
    wanted = os.environ.get("ROLLOUT_VLLM_TEST_LOGS")
    if wanted:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        return Path(wanted)
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def tied_replica(checkpoints: dict[str, list[Path]], replica_logs: Path) -> Iterator[Replica]:
    yield from _serve("tied", checkpoints, replica_logs)


@pytest.fixture(scope="session")
def untied_replica(checkpoints: dict[str, list[Path]], replica_logs: Path) -> Iterator[Replica]:
    seqs = f"--vllm-arg=--max-num-seqs={UNTIED_MAX_NUM_SEQS}"
    yield from _serve("untied", checkpoints, replica_logs, seqs)


@pytest.fixture(scope="module")
def replica_url(tied_replica: Replica, checkpoints: dict[str, list[Path]]) -> Iterator[str]:
    """The contract tests' replica; their weight update loads a checkpoint that differs."""
    before = os.environ.get("ROLLOUT_UPDATE_WEIGHTS_PATH")
    os.environ["ROLLOUT_UPDATE_WEIGHTS_PATH"] = str(checkpoints["tied"][1])
    try:
        yield tied_replica.url
    finally:
        if before is None:
            os.environ.pop("ROLLOUT_UPDATE_WEIGHTS_PATH", None)
        else:
            os.environ["ROLLOUT_UPDATE_WEIGHTS_PATH"] = before
