"""`rollout up` without `--ray`: the whole pipeline on this machine, in the foreground.

`run_foreground` starts every stage of one run as its own process (`LocalPipeline`: the same
`rollout` commands a user would type, in all three deployment modes: standalone replicas,
the trainer lent to generation with `trainer.lend.enable`, the colocated judge pool with
`reward.judge`), tells `on_started` what runs and where it logs, then blocks:

- until the trainer exits (it reaches `trainer.max_steps`): its exit status is returned
  (without the trainer in the plan, for a trainer of the user's own: until one of the rest);
- until another stage exits first: `StageExitedError` with the end of that stage's log;
- until `timeout_s` passes: `ForegroundTimeoutError`;
- until Ctrl-C or SIGTERM: `KeyboardInterrupt` (SIGTERM is turned into one for the time).

Every way out leaves through `LocalPipeline.stop`: SIGTERM to each process group it started
(trainer and workers first, replicas last), a grace period, then SIGKILL — never a process it
did not start. While it runs, `<run_dir>/up.pid` holds this process's id (`rollout down
--local RUN_DIR` signals it); the file is removed on the way out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.launch.local import LocalPipeline, StageExitedError
from schemas.errors import RolloutError

__all__ = [
    "PID_FILE",
    "ForegroundTimeoutError",
    "run_foreground",
    "running",
    "stop_foreground",
]

PID_FILE = "up.pid"


class ForegroundTimeoutError(RolloutError):
    """The trainer still ran when `rollout up --timeout` ran out."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C while the run is up, so the stages are stopped either way."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _pid_file(run_dir: Path) -> Iterator[None]:
    path = run_dir / PID_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def run_foreground(
    cfg: RunConfig,
    run_dir: Path,
    *,
    replicas: int,
    timeout_s: float | None = None,
    on_started: Callable[[LocalPipeline], None] | None = None,
    on_poll: Callable[[], object] | None = None,
    poll_s: float = 1.0,
    **plan: Any,
) -> int:
    """Run the pipeline until the trainer exits; its exit status (see the module docstring).

    `on_poll` is called every `poll_s` while the trainer runs, and once after it exited (the
    run's progress view). `plan`: the fields of `pipeline.launch.local.StagePlan`
    (`model_dir`, `backend`, ...)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _sigterm_as_interrupt(), _pid_file(run_dir):
        with LocalPipeline(cfg, run_dir, replicas=replicas, **plan) as pipe:
            if on_started is not None:
                on_started(pipe)
            # Without the project's trainer (a trainer of the user's own), until stopped.
            trainer = next((p for p in pipe.processes if p.name == "train"), None)
            while trainer is None or trainer.alive:
                for stage in pipe.processes:
                    if stage is not trainer and stage.proc is not None:
                        if stage.proc.poll() is not None:
                            raise StageExitedError(
                                stage.name, stage.proc.returncode, stage.tail(1500)
                            )
                if deadline is not None and time.monotonic() > deadline:
                    raise ForegroundTimeoutError(
                        f"the trainer still runs after {timeout_s:.0f}s; stopped the run "
                        f"(logs: {run_dir / 'logs'})"
                    )
                if on_poll is not None:
                    on_poll()
                time.sleep(poll_s)
            if on_poll is not None:
                on_poll()
            assert trainer.proc is not None
            return int(trainer.proc.returncode)


def stop_foreground(run_dir: Path) -> int | None:
    """SIGTERM to the `rollout up` of `run_dir` (its pid file); the pid, or None when no
    run is up there (no pid file, or its process is gone: the stale file is removed)."""
    path = run_dir / PID_FILE
    try:
        pid = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    # gone, or its id reused by another process: never signal that
    if not running(pid) or not _is_up(pid):
        path.unlink(missing_ok=True)
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        return None
    return pid


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_up(pid: int) -> bool:
    """Whether `pid` is alive and a `rollout ... up` (its command line has both)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"up" in argv and any(b"rollout" in a or b"pipeline.cli.main" in a for a in argv)
