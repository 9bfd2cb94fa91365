"""The process a stage's Ray actor starts: `python -m pipeline.launch.ray.child <actor pid> <argv>`.

It asks the kernel for SIGTERM when the actor that started it dies (PDEATHSIG), checks the
actor is still its parent (else it exits 1 at once), then runs `pipeline.cli.main.main(argv)` in
its own main thread. Nothing imports this module: it is the leaf that closes the circle
CLI → `launch.ray.stages` → `launch.ray.actor` → child → CLI in a new process, not in the
import graph.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["child_main"]

PR_SET_PDEATHSIG = 1


def child_main(argv: list[str]) -> int:
    """Entry of an actor's child: die with the actor (PDEATHSIG), then run the CLI."""
    parent = int(argv[0])
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the actor died before the line above took effect
        return 1
    from pipeline.cli.main import main

    # What a command re-runs itself with (torchrun, `train --ray`) is sys.argv[1:]: the CLI's
    # arguments, as in a `rollout` process, not the actor's pid in front of them.
    sys.argv = [sys.argv[0], *argv[1:]]
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
