"""Launch `hf` replicas as local subprocesses (benchmarks, the demo, tests).

Each replica is a real `rollout replica serve --backend hf` process, run by this interpreter, on
a free loopback port; `LocalReplicas` waits until every one answers `/health` and stops them
all on exit (SIGTERM, then SIGKILL), whatever happened in between, a failed start included.
`wait_healthy` is that wait for any replica process (hf or vLLM) that someone else launched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from workers.ports import free_port

__all__ = ["LocalReplicas", "wait_healthy"]

ROLLOUT = (sys.executable, "-m", "pipeline.cli.main")
"""The `rollout` command under this interpreter (a venv's `rollout` script need not be on PATH)."""


def healthy(url: str, timeout_s: float = 5.0, *, path: str = "/health") -> bool:
    """Whether the server at `url` answers `path` with 200 now."""
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def wait_healthy(
    url: str,
    alive: Callable[[], bool],
    timeout_s: float,
    *,
    name: str = "replica",
    log: Path | None = None,
    interval_s: float = 0.3,
    path: str = "/health",
) -> None:
    """Poll `url`'s `/health` (or `path`) until it answers 200 while `alive()` holds.

    RuntimeError when the process dies first, TimeoutError at the deadline; both end with the
    tail of `log`, where the reason usually is.
    """
    deadline = time.monotonic() + timeout_s
    while not healthy(url, path=path):
        if not alive():
            raise RuntimeError(f"{name} exited before it was healthy{_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not healthy after {timeout_s:.0f}s{_tail(log)}")
        time.sleep(interval_s)


def _tail(log: Path | None, chars: int = 3000) -> str:
    if log is None or not log.exists():
        return ""
    return f"; the end of {log}:\n{log.read_text(errors='replace')[-chars:]}"


class LocalReplicas:
    """`with LocalReplicas(model_dir, count=2) as reps: reps.addresses`."""

    def __init__(
        self,
        model_dir: str | Path,
        count: int = 2,
        *,
        threads: int = 1,
        log_dir: str | Path | None = None,
        extra_args: tuple[str, ...] = (),
        version: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.count = count
        self.threads = threads
        self.extra_args = extra_args
        self.version = version
        self.env = {**os.environ, **env} if env else None  # added to this process's environment
        self.log_dir = (
            Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="rollout-replicas-"))
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        self.ids: list[str] = []

    def start(self, timeout_s: float = 180.0) -> LocalReplicas:
        """Start every replica and wait until each answers; on any failure, stop them all."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> LocalReplicas:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(self.count):
            port = free_port()
            rid = f"hf-local-{port}"
            log = (self.log_dir / f"{rid}.log").open("wb")
            self.procs.append(
                subprocess.Popen(
                    [
                        *ROLLOUT,
                        "replica",
                        "serve",
                        "--backend",
                        "hf",
                        "--model",
                        self.model_dir,
                        "--port",
                        str(port),
                        "--replica-id",
                        rid,
                        "--threads",
                        str(self.threads),
                        "--version",
                        str(self.version),
                        *self.extra_args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                )
            )
            log.close()
            self.addresses.append(f"http://127.0.0.1:{port}")
            self.ids.append(rid)
        deadline = time.monotonic() + timeout_s
        for proc, address, rid in zip(self.procs, self.addresses, self.ids, strict=True):
            wait_healthy(
                address,
                lambda proc=proc: proc.poll() is None,
                max(0.0, deadline - time.monotonic()),
                name=f"replica {rid}",
                log=self.log_dir / f"{rid}.log",
            )
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> LocalReplicas:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
