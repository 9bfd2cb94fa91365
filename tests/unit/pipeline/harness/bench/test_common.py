"""`pipeline.harness.bench.common`: CPU seconds from the kernel, of this process and of another."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.harness.bench.common import cpu_seconds, per_core_rate


def _spin(seconds: float) -> None:
    end = cpu_seconds() + seconds
    while cpu_seconds() < end:
        sum(range(10_000))


def test_own_cpu_grows_with_work() -> None:
    before = cpu_seconds()
    _spin(0.2)
    assert cpu_seconds() - before >= 0.19  # clock ticks: float sums, not exact


def test_another_process_is_read_from_proc() -> None:
    # A child that burns 0.3 s of CPU, then waits to be read: its accounting, not ours.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "end = os.times().user + 0.3\n"
            "while os.times().user < end: sum(range(10000))\n"
            "print('done', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"done\n"
        assert cpu_seconds(child.pid) >= 0.29
        assert cpu_seconds(os.getpid()) == pytest.approx(cpu_seconds(), abs=0.05)
    finally:
        child.communicate(b"")
    with pytest.raises(ProcessLookupError):
        cpu_seconds(child.pid)


def test_per_core_rate() -> None:
    assert per_core_rate(100, 0.5) == 200.0
    assert per_core_rate(100, 0.0) == 0.0
