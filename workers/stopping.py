"""`StopSignal`: how a long-running stage is asked to stop, by SIGTERM and by Ctrl-C.

A stage that has work in hand finishes it cleanly when asked (the trainer checkpoints and
publishes, then returns its result), so SIGTERM and SIGINT set an event the stage polls.
Before it has anything to finish — importing torch, loading a model, connecting — a clean stop
has nothing to save, and waiting for the load to end before honouring Ctrl-C made a person
wait tens of seconds. So until the stage calls `graceful()`, SIGINT interrupts at once
(`KeyboardInterrupt`, which the CLI turns into one line and exit 130); SIGTERM, a supervisor's
stop, is always graceful. Signal handlers run in the main thread, so `install` must be called
there.

`StageTempFailure` is how a stage ends when starting it again later is the whole remedy (the
broker was unreachable, work failed and will be redelivered): the CLI says its message in one
line and exits 75 (EX_TEMPFAIL), which supervisors restart.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from schemas.errors import RolloutError

__all__ = ["EX_TEMPFAIL", "StageTempFailure", "StopSignal"]

EX_TEMPFAIL = 75


class StageTempFailure(RolloutError):
    """The stage stopped for a reason that starting it again later removes (exit 75)."""

    exit_code = EX_TEMPFAIL


class StopSignal(threading.Event):
    """An event set by SIGTERM/SIGINT; SIGINT raises `KeyboardInterrupt` until `graceful()`."""

    def __init__(self, *, graceful: bool = False) -> None:
        super().__init__()
        self._graceful = graceful

    def install(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def graceful(self) -> None:
        """From now on, SIGINT too only sets the event (the stage has work to finish)."""
        self._graceful = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and not self._graceful:
            raise KeyboardInterrupt
        self.set()
