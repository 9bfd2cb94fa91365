"""Start N trainer ranks on this node through torchrun, from a plain `rollout train` process.

`trainer.nproc > 1` in a process that torchrun did not start (no `WORLD_SIZE`) re-runs the same
command under `python -m torch.distributed.run --standalone --nproc_per_node N`, so every rank
parses the same config files, overrides and environment (no secret is written anywhere), and
`workers.trainer.sharded` takes over in each. SIGTERM and SIGINT are passed on to torchrun, which
passes them on to the ranks; the exit status is torchrun's (non-zero when any rank failed).
Imports no torch: this process only waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

__all__ = ["launched_by_torchrun", "relaunch", "torchrun_command"]


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int, module: str, argv: list[str]) -> list[str]:
    """`python -m module *argv` as `nproc` ranks of one node, under this interpreter."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    return [*torchrun, "--nproc_per_node", str(nproc), "-m", module, *argv]


def relaunch(nproc: int, module: str, argv: list[str]) -> int:
    """Run `python -m module *argv` as `nproc` torchrun ranks; returns torchrun's exit status."""
    proc = subprocess.Popen(torchrun_command(nproc, module, argv))

    def forward(signum: int, _: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
