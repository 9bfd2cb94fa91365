"""Stopping a child and everything it started, processes in sessions of their own included.

A launcher starts each stage as the leader of its own process group, so one signal to the
group reaches the stage and whatever it started there. Not everything stays in the group:
a vLLM replica's adapter starts vLLM in a session of its own (`child_server`), and vLLM's
engine processes live in that one; a group signal misses them, and once the adapter is
SIGKILLed they are orphans that keep their GPUs. So a stop remembers the sessions of every
process under its children (read from `/proc` before the first signal and again before the
last) and, once the grace period is over, SIGKILLs every process still in one of those
sessions. A session id is the id of the process that began it, which was under a child of
ours when it was read: the stop never touches a process that the run did not start.
Outside Linux (no `/proc`) only the groups are signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

__all__ = ["alive_in", "kill_sessions", "sessions_under"]


def _table() -> dict[int, tuple[int, int]]:
    """Every live (not zombie) process: pid → (parent pid, session id)."""
    table: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        if fields[0] in ("Z", "X"):
            continue
        table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


def sessions_under(roots: Iterable[int]) -> set[int]:
    """The sessions of `roots` and of every process under them (this process's own left
    out: it is never one of the run's)."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        found.add(table[pid][1])
        todo.extend(children.get(pid, []))
    found.discard(os.getsid(0))
    return found


def alive_in(sessions: set[int]) -> list[int]:
    """The live processes of `sessions`."""
    if not sessions:
        return []
    me = os.getpid()
    return [pid for pid, (_, sid) in _table().items() if sid in sessions and pid != me]


def kill_sessions(sessions: set[int], sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to every live process of `sessions`; the pids signalled."""
    hit = alive_in(sessions)
    for pid in hit:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    return hit
