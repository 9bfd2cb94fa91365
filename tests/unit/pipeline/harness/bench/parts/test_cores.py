"""The fair CPU split: which cores each group gets, pinning real processes, restoring them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.harness.bench.parts.cores import CoreSplit, split_of


def test_two_cpus_split_into_compute_and_transport() -> None:
    plan, reason = split_of({3, 1, 2})
    assert plan == {"compute": [1], "transport": [2]} and reason is None


def test_one_cpu_is_no_split_and_says_why() -> None:
    plan, reason = split_of({0})
    assert plan is None
    assert reason is not None and "1 usable CPU" in reason


def test_turned_off_pins_nothing_and_reports_null() -> None:
    before = os.sched_getaffinity(0)
    with CoreSplit(enabled=False) as split:
        split.pin("transport", os.getpid())
        assert os.sched_getaffinity(0) == before
        report = split.report({"loops": "compute"})
    assert report == {"cpu_split": None, "cpu_split_reason": "turned off (--cpu-split 0)"}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_pins_every_thread_of_a_process_and_restores_it() -> None:
    before = os.sched_getaffinity(0)
    # A child with a second thread: affinity is per thread, so both must move.
    code = "import threading,time; threading.Thread(target=time.sleep,args=(30,)).start()\n"
    code += "print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        tasks = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tasks) == 2
        with CoreSplit() as split:
            assert split.plan is not None
            assert os.sched_getaffinity(0) == set(split.plan["compute"])  # this process
            split.pin("transport", child.pid)
            for tid in tasks:
                assert os.sched_getaffinity(tid) == set(split.plan["transport"])
            report = split.report({"loops": "compute", "reader": "transport"})
            assert report["cpu_split"] == {
                "loops": split.plan["compute"],
                "reader": split.plan["transport"],
            }
        assert os.sched_getaffinity(0) == before
        for tid in tasks:
            assert os.sched_getaffinity(tid) == before
    finally:
        child.kill()
        child.wait()


def test_a_pid_that_is_gone_is_skipped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with CoreSplit() as split:
        split.pin("transport", child.pid)  # exited: nothing to pin, no error
        split.pin("transport", None)
