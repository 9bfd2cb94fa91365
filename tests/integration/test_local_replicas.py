"""`LocalReplicas`: a start that fails leaves no replica process behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.llm.replicas.local import LocalReplicas


def test_a_start_that_times_out_stops_the_replicas(tiny_model: Path, tmp_path: Path) -> None:
    replicas = LocalReplicas(tiny_model, count=2, log_dir=tmp_path)
    with pytest.raises(TimeoutError, match="not healthy"):
        with replicas.start(timeout_s=0.05):  # still importing torch by then
            pass
    assert len(replicas.procs) == 2
    assert all(proc.poll() is not None for proc in replicas.procs)
