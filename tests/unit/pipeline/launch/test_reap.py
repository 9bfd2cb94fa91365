"""A stop finds the sessions its children's processes began (vLLM's) and kills what is in
them, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pipeline.launch.foreground import running
from pipeline.launch.reap import alive_in, kill_sessions, sessions_under

# A child that starts a grandchild in a session of its own (as an adapter starts vLLM), which
# ignores SIGTERM, prints its pid and stays.
CHILD = """
import subprocess, sys, time
grand = subprocess.Popen(
    [sys.executable, "-c", "import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
     "while True: time.sleep(1)"],
    start_new_session=True,
)
print(grand.pid, flush=True)
while True:
    time.sleep(1)
"""


def test_the_sessions_under_a_child_are_found_and_reaped() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    grand = 0
    try:
        assert child.stdout is not None
        grand = int(child.stdout.readline())
        sessions = sessions_under([child.pid])
        assert sessions == {child.pid, grand}  # each leads its own session
        child.kill()  # the group kill of old: the grandchild lives on, an orphan
        child.wait()
        assert running(grand) and alive_in(sessions) == [grand]
        assert kill_sessions(sessions) == [grand]
        deadline = time.monotonic() + 5
        while running(grand) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(grand)
        assert bystander.poll() is None  # not one of them: untouched
    finally:
        for proc in (child, bystander):
            proc.kill()
            proc.wait()
        if grand and running(grand):
            os.kill(grand, signal.SIGKILL)
