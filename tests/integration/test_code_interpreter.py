"""The code interpreter's sandbox against hostile programs.

Every hostile test is bounded even if a defence failed: short wall-time limits (the whole pid
namespace is killed at the limit), small process and memory limits, and the fork bomb only
runs after a bounded probe has shown that the process limit holds. Requires Linux with
`unshare` (util-linux); as root (CI) the full root mode is exercised and must work.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.agent_loop.exceptions import SandboxError, ToolArgumentError
from workers.agent_loop.tools.code_interpreter import CodeInterpreterTool
from workers.agent_loop.tools.sandbox import Sandbox, SandboxConfig, SandboxLimits

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or not Path("/proc/self/ns/net").exists(),
    reason="needs Linux namespaces and util-linux unshare",
)


def sandbox(**limits: float) -> Sandbox:
    base = {"wall_time_s": 5.0, "max_processes": 16, "memory_mb": 256}
    return Sandbox(SandboxConfig(limits=SandboxLimits(**{**base, **limits})))


def sandbox_processes(config: SandboxConfig) -> list[int]:
    """Host pids running as a sandbox uid (root mode)."""
    low, high = config.uid_base, config.uid_base + config.uid_range
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:"):
                if low <= int(line.split()[1]) < high:
                    pids.append(int(entry.name))
                break
    return pids


@pytest.fixture
def tcp_server() -> Iterator[int]:
    """A listening server on 127.0.0.1 in the host's network namespace."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"hello")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=2)
    server.close()


async def test_runs_code_and_reports() -> None:
    box = sandbox()
    result = await box.run_python("import os, sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)")
    assert result.stdout == "42\n" and result.stderr == "oops\n"
    assert result.exit_code == 0 and not result.timed_out and not result.output_truncated
    result = await box.run_python("import sys; sys.exit(3)")
    assert result.exit_code == 3
    result = await box.run_python(
        "import os; print(os.getuid(), os.getpid(), len(os.listdir('/proc')))"
    )
    uid, pid, entries = map(int, result.stdout.split())
    assert pid == 2  # pid 1 is the sandbox's init, in a pid namespace of its own
    assert entries < 80  # only the sandbox's own processes are in /proc
    if IS_ROOT:
        assert box.config.uid_base <= uid < box.config.uid_base + box.config.uid_range


async def test_tool_response_text() -> None:
    tool = CodeInterpreterTool(config={"limits": {"wall_time_s": 5}})
    result = await tool.execute(None, {"code": "print(sum(range(10)))"})
    assert result.text == "45" and result.metrics["exit_code"] == 0
    result = await tool.execute(None, {"code": "1 / 0"})
    assert "ZeroDivisionError" in result.text and result.text.endswith("[exit status 1]")
    assert result.text.startswith("[stderr]")
    assert (await tool.execute(None, {"code": "x = 1"})).text == "[no output]"
    with pytest.raises(ToolArgumentError):
        await tool.execute(None, {"program": "print(1)"})


async def test_no_network(tcp_server: int) -> None:
    with socket.create_connection(("127.0.0.1", tcp_server), timeout=2) as conn:
        assert conn.recv(5) == b"hello"  # reachable from the host
    code = f"""
import socket
for target in [("127.0.0.1", {tcp_server}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(target, timeout=2)
        print("CONNECTED", target)
    except OSError as exc:
        print("refused", exc.errno)
try:
    socket.getaddrinfo("example.com", 80)
    print("RESOLVED")
except OSError:
    print("no dns")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.sendto(b"x", ("8.8.8.8", 53))
    print("SENT")
except OSError:
    print("no udp")
"""
    result = await sandbox().run_python(code)
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert "SENT" not in result.stdout
    assert result.stdout.count("refused") == 2 and "no dns" in result.stdout, result


async def test_cannot_write_outside_scratch() -> None:
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    targets = [
        Path("/tmp") / name,
        REPO / name,
        Path.home() / name,
        Path("/dev/shm") / name,
        Path("/var/tmp") / name,
    ]
    code = f"""
import os
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "w") as handle:
            handle.write("x")
        print("WROTE", path)
    except OSError as exc:
        print("denied", exc.errno)
with open("inside.txt", "w") as handle:
    handle.write("fine")
print("scratch", os.getcwd(), open("inside.txt").read())
"""
    result = await sandbox().run_python(code)
    try:
        assert "WROTE" not in result.stdout, result
        assert result.stdout.count("denied") == len(targets)
        scratch = result.stdout.split("scratch ")[1].split()[0]
        assert result.stdout.strip().endswith("fine")
        assert not Path(scratch).exists()  # removed after the run
    finally:
        for target in targets:
            if target.exists():
                target.unlink()
    for target in targets:
        assert not target.exists()


async def test_hidden_paths_and_setup_failure() -> None:
    shared = Path(tempfile.mkdtemp(prefix="rollout-hide-test-"))
    try:
        shared.chmod(0o755)  # world-readable, as e.g. /home/<user> often is
        secret = shared / "secret.txt"
        secret.write_text("token")
        secret.chmod(0o644)
        code = f"print(open({str(secret)!r}).read())"
        visible = await sandbox().run_python(code)
        assert visible.stdout == "token\n"  # readable unless hidden: reads are not blocked
        config = SandboxConfig(hide_paths=[str(shared)], limits=SandboxLimits(wall_time_s=5))
        hidden = await Sandbox(config).run_python(code)
        assert "token" not in hidden.stdout and "FileNotFoundError" in hidden.stderr
    finally:
        shutil.rmtree(shared)
    broken = Sandbox(SandboxConfig(python="/nonexistent/python3"))
    with pytest.raises(SandboxError, match="set-up failed"):
        await broken.run_python("print(1)")


@pytest.mark.slow
async def test_fork_bomb_is_contained() -> None:
    box = sandbox(max_processes=12, wall_time_s=2.0)
    # Bounded probe first: if the process limit did not hold, stop before the real bomb.
    probe = """
import os, time
n = 0
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    n += 1
print(n)
"""
    result = await box.run_python(probe)
    assert result.exit_code == 0 and int(result.stdout) < 12, result
    bomb = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    peak = 0
    run = asyncio.create_task(box.run_python(bomb))
    while not run.done():
        peak = max(peak, len(sandbox_processes(box.config)))
        await asyncio.sleep(0.2)
    result = await run
    assert result.timed_out and result.exit_code == -9
    if IS_ROOT:
        assert 0 < peak <= 12
    await asyncio.sleep(0.5)
    assert sandbox_processes(box.config) == []  # nothing survived the run
    subprocess.run(["true"], check=True)  # the host can still start processes


@pytest.mark.slow
async def test_orphans_and_new_sessions_do_not_survive() -> None:
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print("parent leaves")
"""
    box = sandbox()
    result = await box.run_python(code)
    assert result.stdout == "parent leaves\n" and result.exit_code == 0
    await asyncio.sleep(0.5)
    assert sandbox_processes(box.config) == []


async def test_memory_bomb_hits_the_limit() -> None:
    code = """
chunks = []
while True:
    chunks.append(bytearray(16 * 1024 * 1024))
"""
    result = await sandbox(memory_mb=192).run_python(code)
    assert result.exit_code == 1 and "MemoryError" in result.stderr, result
    result = await sandbox(memory_mb=192).run_python("x = bytearray(4 * 1024 ** 3)")
    assert "MemoryError" in result.stderr


@pytest.mark.slow
async def test_infinite_loop_is_killed_at_the_wall_time() -> None:
    result = await sandbox(wall_time_s=1.5, cpu_time_s=30).run_python("while True: pass")
    assert result.timed_out and result.exit_code == -9
    assert 1.5 <= result.duration_s < 5
    # A sleeping program uses no CPU: only the wall time stops it.
    result = await sandbox(wall_time_s=1.0).run_python("import time; time.sleep(60)")
    assert result.timed_out


@pytest.mark.slow
async def test_cpu_limit() -> None:
    tool = CodeInterpreterTool(config={"limits": {"wall_time_s": 10, "cpu_time_s": 1}})
    result = await tool.execute(None, {"code": "while True: pass"})
    assert result.metrics["exit_code"] == -24 and not result.metrics["timed_out"]
    assert "CPU-time limit exceeded" in result.text


async def test_output_is_truncated() -> None:
    code = "import sys\nfor _ in range(200_000):\n    sys.stdout.write('x' * 99 + '\\n')"
    box = sandbox(max_output_bytes=10_000)
    result = await box.run_python(code)
    assert result.output_truncated and len(result.stdout) == 10_000
    assert result.duration_s < 5
    tool = CodeInterpreterTool(config={"limits": {"max_output_bytes": 1000}})
    text = (await tool.execute(None, {"code": code})).text
    assert text.endswith("[output truncated at 1000 bytes; killed]")


async def test_file_size_and_scratch_limits() -> None:
    code = """
try:
    with open("big", "wb") as handle:
        handle.write(b"x" * (3 * 1024 * 1024))
    print("wrote")
except OSError as exc:
    print("refused", exc.errno)
"""
    result = await sandbox(file_size_mb=1).run_python(code)
    assert "refused 27" in result.stdout  # EFBIG
    result = await sandbox(file_size_mb=16, scratch_mb=2).run_python(code)
    assert "refused 28" in result.stdout  # ENOSPC: the scratch tmpfs is full


async def test_concurrent_runs_are_isolated() -> None:
    box = Sandbox(SandboxConfig(max_concurrent=2, limits=SandboxLimits(wall_time_s=5)))
    code = "import os\nopen('mine', 'w').write(str(os.getpid()))\nprint(sorted(os.listdir('.')))"
    results = await asyncio.gather(*(box.run_python(code) for _ in range(3)))
    assert [r.stdout for r in results] == ["['main.py', 'mine']\n"] * 3


async def test_cancelled_run_leaves_nothing_behind() -> None:
    box = sandbox(wall_time_s=30)
    run = asyncio.create_task(
        box.run_python("import time; print('up', flush=True); time.sleep(60)")
    )
    for _ in range(50):
        if sandbox_processes(box.config):
            break
        await asyncio.sleep(0.1)
    assert sandbox_processes(box.config) or not IS_ROOT  # it was running
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await asyncio.sleep(0.3)
    assert sandbox_processes(box.config) == []
