"""`rollout down --local` signals only the `rollout up` named in the run's pid file: never a
process whose id was reused, never one that already exited (real processes, no broker)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from pipeline.launch.foreground import PID_FILE, running, stop_foreground

SLEEP = "import time; time.sleep(60)"


def test_no_pid_file_is_no_run(tmp_path: Path) -> None:
    assert stop_foreground(tmp_path) is None


def test_a_pid_reused_by_another_process_is_left_alone(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", SLEEP])
    try:
        (tmp_path / PID_FILE).write_text(f"{other.pid}\n")
        assert stop_foreground(tmp_path) is None
        assert other.poll() is None  # not signalled
        assert not (tmp_path / PID_FILE).exists()  # the stale file is gone
    finally:
        other.kill()
        other.wait()


def test_a_live_rollout_up_gets_sigterm(tmp_path: Path) -> None:
    # Its command line reads like `python -m pipeline.cli.main up` (the arguments after -c);
    # Popen returns after the exec, so /proc already shows it.
    up = subprocess.Popen([sys.executable, "-c", SLEEP, "pipeline.cli.main", "up"])
    try:
        (tmp_path / PID_FILE).write_text(f"{up.pid}\n")
        assert stop_foreground(tmp_path) == up.pid
        assert up.wait(timeout=10) == -15
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_an_exited_process_is_not_running_even_before_it_is_reaped(tmp_path: Path) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{done.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.05)  # a zombie until waited for
    assert not running(done.pid)
    (tmp_path / PID_FILE).write_text(f"{done.pid}\n")
    assert stop_foreground(tmp_path) is None
    done.wait()
    assert not running(done.pid)
