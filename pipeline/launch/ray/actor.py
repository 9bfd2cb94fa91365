"""The body of one stage's Ray actor: it starts, watches and stops one `rollout` child.

`StageRunner` is a plain class (the launcher wraps it with `ray.remote`), so importing this
module imports no Ray. The child is `python -m pipeline.launch.ray.child <actor pid> <rollout argv>`
(its own module, so this one never imports the CLI that launches it): it asks the kernel for
SIGTERM when the actor that started it dies (PDEATHSIG), checks the actor is still its
parent, then runs `pipeline.cli.main.main` in its own main thread, where the workers install
their signal handlers and event loops. The child leads its own process
group, so a stop (SIGTERM, a grace period, SIGKILL) reaches whatever it started too, and the
sessions begun under it (vLLM's: `pipeline.launch.reap`) are SIGKILLed after the grace.
The child sees exactly the GPUs Ray granted the actor: `CUDA_VISIBLE_DEVICES` is set for it
from `ray.get_gpu_ids()`, empty when none (Ray leaves a zero-GPU actor's variable unset, so
the child would otherwise see every GPU of the node); an `env` the caller passes wins (the
trainer's ranks see their node's peers).
Invariant: the actor's methods run on its main thread, the thread that started the child,
which is the thread PDEATHSIG watches.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.launch.devices import gpu_env
from pipeline.launch.local import REPO, log_tail, spawn_logged
from pipeline.launch.reap import alive_in, kill_sessions, sessions_under
from workers.ports import free_port

__all__ = ["StageRunner"]

log = logging.getLogger("rollout.ray_stage")


class StageRunner:
    """One stage's actor: a `rollout` child process, its log, its stop."""

    def __init__(self, name: str, log_path: str) -> None:
        self.name = name
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.sessions: set[int] = set()  # of the child's tree, read before each signal

    def where(self) -> dict[str, Any]:
        """This actor's node, a port free on all its interfaces (for a replica, or rank 0's
        rendezvous), the GPUs Ray granted it (their ids on the node) and the placement group
        it was scheduled into (None: none; the trainer's, for colocated replicas)."""
        import ray

        port = free_port("0.0.0.0")
        ctx = ray.get_runtime_context()
        gpus = [str(g) for g in ray.get_gpu_ids()]
        ip = ray.util.get_node_ip_address()
        group = ctx.get_placement_group_id()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ip,
            "port": port,
            "gpus": gpus,
            "placement_group": group,
        }

    def start(
        self, cli_argv: list[str], env: dict[str, str], cwd: str | None = None
    ) -> dict[str, Any]:
        """Start the child in `cwd` (default: the checkout; a caller's own directory keeps
        its relative paths meaning the same), with this checkout importable either way."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        import ray

        self.argv = [sys.executable, "-m", "pipeline.launch.ray.child", str(os.getpid()), *cli_argv]
        own = gpu_env([str(g) for g in ray.get_gpu_ids()])
        child_env = {**os.environ, **own, **env, "PYTHONUNBUFFERED": "1"}
        paths = [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        child_env["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
        self.proc = spawn_logged(self.argv, self.log_path, child_env, cwd or REPO)
        return self.describe()

    def describe(self) -> dict[str, Any]:
        import ray

        return {
            "stage": self.name,
            "node": ray.util.get_node_ip_address(),
            "pid": self.proc.pid if self.proc else None,
            "returncode": self.poll(),
            "log": str(self.log_path),
        }

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM, wait up to `grace_s` for the child and its sessions' processes, then
        SIGKILL the child's group and what is left of those sessions; its exit status."""
        if self.proc is None:
            return None
        self.terminate()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._remember_sessions()
            if self.proc.poll() is not None and not alive_in(self.sessions):
                break
            time.sleep(0.2)
        else:
            log.warning("%s did not stop within %.0fs; killing it", self.name, grace_s)
        self._remember_sessions()
        self._signal(signal.SIGKILL, after_exit=True)
        if left := kill_sessions(self.sessions):
            log.warning("%s: killed %d process(es) left behind: %s", self.name, len(left), left)
        return self.proc.wait(timeout=10)

    def alive_pids(self) -> list[int]:
        """The live processes of the child's sessions (none once stopped)."""
        self._remember_sessions()
        return alive_in(self.sessions)

    def _remember_sessions(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.sessions |= sessions_under([self.proc.pid])

    def tail(self, chars: int = 2000) -> str:
        return log_tail(self.log_path, chars)

    def _signal(self, sig: int, *, after_exit: bool = False) -> None:
        """Signal the child's process group; `after_exit`: also once the child has exited,
        to reach what it left behind in its group."""
        if self.proc is None or (not after_exit and self.proc.poll() is not None):
            return
        self._remember_sessions()
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
