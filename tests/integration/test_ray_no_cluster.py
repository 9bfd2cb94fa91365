"""`--ray` without an address on a machine whose recorded Ray head is gone: one line, at once.

`ray start` records its head's address in `<tmp>/ray/ray_current_cluster`; the file outlives
the head (a reboot, a killed head, a changed address). Ray's own "auto" then retries the dead
head for minutes; the launcher probes it first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.test_cli_first_contact import assert_one_line, rollout

pytest.importorskip("ray")


@pytest.mark.parametrize("command", [["down", "--ray"], ["train", "--nproc", "2", "--ray"]])
def test_a_dead_recorded_head_is_one_line(command: list[str], tmp_path: Path) -> None:
    record = tmp_path / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    record.write_text(dead)
    env = {"RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": ""}
    run = rollout(*command, env=env)
    assert_one_line(run, 1, f"no Ray cluster answers at {dead}", str(record))
