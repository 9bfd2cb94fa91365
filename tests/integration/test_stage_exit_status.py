"""An agent-loop worker that cannot reach the broker at start says so and exits 75.

75 (EX_TEMPFAIL) is what the worker returns for any Kafka failure, so a supervisor (the chaos
driver, systemd, a Ray actor) starts it again; a traceback and status 1 read as a crash.
Nothing listens on the port the test picks, so the bootstrap is refused at once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, free_port


def test_agent_loop_without_a_broker_exits_75_with_one_line(tiny_model: Path) -> None:
    bootstrap = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli.main",
            "--bootstrap",
            bootstrap,
            "worker",
            "agent-loop",
            "--model",
            str(tiny_model),
            "--replica",
            f"http://127.0.0.1:{free_port()}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert f"rollout: error: cannot reach Kafka at {bootstrap}" in proc.stderr
    assert "Traceback" not in proc.stderr
