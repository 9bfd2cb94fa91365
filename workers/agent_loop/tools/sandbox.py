"""Run an untrusted Python program in a throw-away Linux sandbox; not a VM.

`Sandbox.run_python(code)` writes the program into a fresh scratch directory and starts

    unshare --net --pid --mount --ipc --uts --fork --kill-child --mount-proc
            [--user --map-root-user]
        python -I -S sandbox_child.py SPEC      (pid 1: mounts, then reaps; see sandbox_child)
            └── (limits, uid drop) execve(python -I -S -B main.py)

in a new session, with stdin closed, a minimal environment, and stdout/stderr read through a
byte cap. Defences, and what each does *not* cover:

- network: a new network namespace with only a down loopback; every socket connect (also to
  127.0.0.1 and DNS) fails. Unix sockets reachable by *path* are not covered by this (they are
  by the read-only mounts and the unprivileged uid for sockets that need write permission).
- processes: pid namespace (when the program exits or is killed, its init leaves and the
  kernel kills every process left behind, also ones that called `setsid`), `RLIMIT_NPROC` for
  a per-run uid (root mode; counts threads too), and a wall-time limit that SIGKILLs the
  process group.
  As root, `RLIMIT_NPROC` alone is *not* enforced: the uid drop is what makes it real.
- privileges: root mode runs the program as a per-run unprivileged uid/gid (random in
  `[uid_base, uid_base + uid_range)`, which must be unused on the host; two workers on one
  host drawing the same uid at once only share its process limit), no supplementary groups,
  `PR_SET_NO_NEW_PRIVS`.
  Non-root hosts use an unprivileged user namespace instead (`userns` mode): the program is
  "root" only inside it, and the host's `RLIMIT_NPROC` applies to its real uid.
- filesystem: every mount read-only and nosuid; the only writable place is a tmpfs (size and
  inode capped) over the scratch directory, so nothing reaches the host's disk; `hide_paths`
  (default `/root`, `/home`) covered by an empty tmpfs. World-readable files elsewhere
  (system files, the repository) stay *readable*.
- resources: `RLIMIT_CPU`, `RLIMIT_AS` (per process: the bound on total memory is
  processes x address space), `RLIMIT_FSIZE`, `RLIMIT_NOFILE`, no core dumps, `nice`.
- output: stdout + stderr together capped at `max_output_bytes`; past the cap the sandbox is
  killed and the result marked truncated, so a program printing gigabytes costs at most the cap.
Not covered: kernel exploits, side channels, CPU/memory cgroup accounting, reading
world-readable files. Run the worker in a container or VM for untrusted models at scale.

Set-up failures (no `unshare`, no permission for namespaces) raise `SandboxError`, never run
the program unsandboxed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.agent_loop.exceptions import SandboxError

__all__ = ["Sandbox", "SandboxConfig", "SandboxLimits", "SandboxResult"]

logger = logging.getLogger("rollout.tools.sandbox")

_CHILD = Path(__file__).with_name("sandbox_child.py")
_MIB = 1024 * 1024
_UNSHARE_NOISE = "unshare: sigprocmask unblock failed: Invalid argument\n"


class SandboxLimits(BaseModel):
    """Resource limits of one run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_time_s: float = Field(default=10.0, gt=0, le=600, description="Killed after this.")
    cpu_time_s: int = Field(default=10, ge=1, le=600, description="RLIMIT_CPU (SIGXCPU, KILL).")
    memory_mb: int = Field(default=512, ge=64, description="RLIMIT_AS per process.")
    file_size_mb: int = Field(default=16, ge=1, description="RLIMIT_FSIZE: largest file.")
    scratch_mb: int = Field(default=64, ge=1, description="Size of the writable scratch tmpfs.")
    max_processes: int = Field(
        default=32, ge=2, description="RLIMIT_NPROC of the sandbox uid (threads count)."
    )
    open_files: int = Field(default=64, ge=16, description="RLIMIT_NOFILE.")
    max_output_bytes: int = Field(
        default=64 * 1024, ge=256, description="Cap on stdout + stderr; killed past it."
    )
    nice: int = Field(default=10, ge=0, le=19, description="Scheduling niceness added.")


class SandboxConfig(BaseModel):
    """Where and how sandboxes run. See the module docstring for what each defence does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    mode: Literal["auto", "root", "userns"] = Field(
        default="auto", description="auto: `root` when running as root, else `userns`."
    )
    uid_base: int = Field(
        default=1_800_000_000, ge=1000, le=4_000_000_000, description="First sandbox uid."
    )
    uid_range: int = Field(
        default=65_536, ge=1, le=200_000_000, description="Sandbox uids are drawn from here."
    )
    scratch_root: str | None = Field(
        default=None, description="Parent of the scratch dirs; None = the system temp dir."
    )
    hide_paths: list[str] = Field(
        default_factory=lambda: ["/root", "/home"],
        description="Directories covered by an empty tmpfs inside the sandbox.",
    )
    python: str | None = Field(
        default=None, description="Interpreter for the program; None = this one's base."
    )
    unshare: str = Field(default="unshare", description="util-linux unshare binary.")
    max_concurrent: int = Field(default=4, ge=1, description="Runs at once per Sandbox.")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What one run did. `exit_code` is negative when a signal ended it (-9: SIGKILL)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    output_truncated: bool
    duration_s: float


class _Capture:
    """stdout and stderr bytes under one shared cap; the first bytes are kept."""

    def __init__(self, cap: int) -> None:
        self.remaining = cap
        self.parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.truncated = False
        self.full = asyncio.Event()

    def add(self, name: str, chunk: bytes) -> None:
        if len(chunk) > self.remaining:
            chunk = chunk[: self.remaining]
            self.truncated = True
            self.full.set()
        if chunk:
            self.remaining -= len(chunk)
            self.parts[name].append(chunk)

    def text(self, name: str) -> str:
        return b"".join(self.parts[name]).decode("utf-8", errors="replace")


class Sandbox:
    """Runs Python programs under the defences above; at most `max_concurrent` at a time.

    Holds no process between runs; safe to share among the coroutines of one event loop.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        mode = self.config.mode
        if mode == "auto":
            mode = "root" if os.geteuid() == 0 else "userns"
        self.mode: Literal["root", "userns"] = mode  # type: ignore[assignment]
        if self.mode == "userns" and os.geteuid() == 0:
            # Mapped to real root: RLIMIT_NPROC is not enforced and files are root's.
            logger.warning("sandbox mode 'userns' as root is weaker than 'root' mode")
        self._gate = asyncio.Semaphore(self.config.max_concurrent)
        self._uids_in_use: set[int] = set()

    def _python(self) -> str:
        # The base interpreter, not a venv shim: with -I -S no site-packages are used anyway.
        return self.config.python or os.path.realpath(sys.executable)

    def _exposed(self, python: str) -> list[str]:
        """Install trees the program needs (re-exposed read-only where a hidden path covers)."""
        prefix = str(Path(python).resolve().parent.parent)
        paths = {prefix, os.path.realpath(sys.base_prefix)} if not self.config.python else {prefix}
        return sorted(paths)

    def _hidden(self, exposed: list[str]) -> list[str]:
        """`hide_paths`, plus (root mode) the topmost ancestor of each exposed tree that the
        sandbox uid could not traverse (e.g. /root for a pyenv interpreter): covering it lets
        the tree be re-exposed through world-traversable tmpfs directories."""
        hidden = list(self.config.hide_paths)
        if self.mode != "root":
            return hidden
        for path in exposed:
            for parent in reversed(Path(path).parents):
                if parent != Path("/") and not parent.stat().st_mode & stat.S_IXOTH:
                    if not any(_under(str(parent), h) for h in hidden):
                        hidden.append(str(parent))
                    break
        return hidden

    def _new_uid(self) -> int:
        while True:
            uid = self.config.uid_base + secrets.randbelow(self.config.uid_range)
            if uid not in self._uids_in_use:
                self._uids_in_use.add(uid)
                return uid

    def _command(self, scratch: str, status_fd: int, uid: int) -> list[str]:
        unshare = shutil.which(self.config.unshare)
        if unshare is None:
            raise SandboxError(f"sandbox unavailable: {self.config.unshare!r} not found")
        python, limits = self._python(), self.config.limits
        exposed = self._exposed(python)
        namespaces = ["--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]
        if self.mode == "userns":
            namespaces += ["--user", "--map-root-user"]
        spec = {
            "status_fd": status_fd,
            "scratch": scratch,
            "script": "main.py",
            "scratch_bytes": limits.scratch_mb * _MIB,
            "owner": [uid, uid] if self.mode == "root" else [0, 0],
            "drop_to": [uid, uid] if self.mode == "root" else None,
            "hide": self._hidden(exposed),
            "expose": exposed,
            "nice": limits.nice,
            "limits": {
                "cpu_s": limits.cpu_time_s,
                "address_space_bytes": limits.memory_mb * _MIB,
                "file_size_bytes": limits.file_size_mb * _MIB,
                "processes": limits.max_processes,
                "open_files": limits.open_files,
            },
            "argv": [python, "-I", "-S", "-B", "main.py"],
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": scratch,
                "TMPDIR": scratch,
                "LANG": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8",
            },
        }
        child = [os.path.realpath(sys.executable), "-I", "-S", "-B", str(_CHILD)]
        return [unshare, *namespaces, "--mount-proc", "--", *child, json.dumps(spec)]

    async def run_python(self, code: str) -> SandboxResult:
        """Run `code` as `main.py` in a fresh sandbox; raises `SandboxError` if set-up fails.

        Never raises for what the program does: crashes, timeouts and limits show in the result.
        """
        async with self._gate:
            uid = self._new_uid()
            scratch = tempfile.mkdtemp(prefix="rollout-sbx-", dir=self.config.scratch_root)
            try:
                Path(scratch, "main.py").write_text(code, encoding="utf-8")
                os.chmod(scratch, stat.S_IRWXU)
                return await self._run(scratch, uid)
            finally:
                self._uids_in_use.discard(uid)
                # The program only ever wrote into its tmpfs (gone with its mount namespace).
                shutil.rmtree(scratch, ignore_errors=True)

    async def _run(self, scratch: str, uid: int) -> SandboxResult:
        limits = self.config.limits
        status_r, status_w = os.pipe()
        started = time.monotonic()
        try:
            command = self._command(scratch, status_w, uid)
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_w,),
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
                cwd="/",
            )
        except OSError as exc:
            os.close(status_r)
            raise SandboxError(f"sandbox unavailable: {exc}") from exc
        finally:
            os.close(status_w)
        capture = _Capture(limits.max_output_bytes)
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [
            asyncio.create_task(_pump(proc.stdout, "stdout", capture)),
            asyncio.create_task(_pump(proc.stderr, "stderr", capture)),
        ]
        waiter = asyncio.create_task(proc.wait())
        full = asyncio.create_task(capture.full.wait())
        timed_out = False
        try:
            done, _ = await asyncio.wait(
                {waiter, full}, timeout=limits.wall_time_s, return_when=asyncio.FIRST_COMPLETED
            )
            timed_out = not done
        finally:  # also when the caller is cancelled: never leave a sandbox running
            if proc.returncode is None:
                await _kill(proc)
            full.cancel()
            waiter.cancel()
            await _settle(proc, pumps)
            status = _read_status(status_r)
        killed = timed_out or capture.truncated
        if "setup_error" in status:
            logger.error("sandbox set-up failed: %s", status["setup_error"])
            raise SandboxError(f"sandbox set-up failed: {status['setup_error']}")
        if killed or "exit_code" not in status:
            exit_code = -signal.SIGKILL  # we killed it, or something killed pid 1
        else:
            exit_code = int(status["exit_code"])
        stderr = capture.text("stderr")
        if killed:  # util-linux 2.38's unshare notes its own SIGKILL'd child on stderr
            stderr = stderr.replace(_UNSHARE_NOISE, "")
        result = SandboxResult(
            stdout=capture.text("stdout"),
            stderr=stderr,
            exit_code=exit_code,
            timed_out=timed_out,
            output_truncated=capture.truncated,
            duration_s=time.monotonic() - started,
        )
        logger.debug(
            "sandbox run: exit=%s timed_out=%s truncated=%s %.2fs",
            exit_code,
            timed_out,
            capture.truncated,
            result.duration_s,
        )
        return result


async def _pump(stream: asyncio.StreamReader, name: str, capture: _Capture) -> None:
    """Read to EOF; past the cap the bytes are dropped (reading on lets the pipe close)."""
    while chunk := await stream.read(64 * 1024):
        capture.add(name, chunk)


async def _settle(proc: asyncio.subprocess.Process, pumps: list[asyncio.Task[None]]) -> None:
    """Reap the process and stop the readers, even if the pipes stay open."""
    try:
        await asyncio.wait_for(proc.wait(), timeout=5.0)
    except TimeoutError:
        logger.error("sandbox pid %s did not exit after SIGKILL", proc.pid)
    _, pending = await asyncio.wait(pumps, timeout=1.0)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the sandbox: its pid 1 first (the kernel then kills the whole pid namespace and
    `unshare` reaps it, leaving no zombie to the host's init), then the process group."""
    for child in _children(proc.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        await asyncio.wait_for(proc.wait(), timeout=2.0)
    except TimeoutError:
        pass
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text(encoding="ascii")
    except OSError:
        return []
    return [int(part) for part in text.split()]


def _read_status(fd: int) -> dict[str, Any]:
    """The sandbox init's report (see sandbox_child); never blocks, so a stray holder of the
    pipe cannot stall the event loop. Later lines win (the program's exit after set-up)."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    status: dict[str, Any] = {}
    for line in b"".join(chunks).decode("utf-8", errors="replace").splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict):
            status.update(message)
    return status
