"""`LocalReplicas`: a start that fails leaves no replica process behind; `wait_healthy`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.launch.replicas import LocalReplicas, wait_healthy
from workers.ports import free_port


def test_a_start_that_times_out_stops_the_replicas(tiny_model: Path, tmp_path: Path) -> None:
    replicas = LocalReplicas(tiny_model, count=2, log_dir=tmp_path)
    with pytest.raises(TimeoutError, match="not healthy"):
        with replicas.start(timeout_s=0.05):  # still importing torch by then
            pass
    assert len(replicas.procs) == 2
    assert all(proc.poll() is not None for proc in replicas.procs)


def test_waiting_on_a_replica_that_dies_says_so_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "replica.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('no such model: /nowhere'); sys.exit(3)"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RuntimeError, match=r"(?s)exited before it was healthy.*no such model"):
        wait_healthy(url, lambda: proc.poll() is None, 60, log=log)
    with pytest.raises(TimeoutError, match="not healthy after 0s"):
        wait_healthy(url, lambda: True, 0.2, interval_s=0.05)
