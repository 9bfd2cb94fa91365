"""`ScorerPool`: CPU-heavy scoring in worker processes, with a hard per-item timeout.

`await pool.run(fn, args, timeout_s)` sends one JSON request to an idle worker
(`workers.reward.pool_worker`) and awaits its reply without blocking the event loop.

Invariants:
- a call never outlasts its timeout: past it, the worker process is SIGKILLed (a sympy
  computation in C code cannot be interrupted any other way), a fresh one is started in the
  background, and the call raises `ScorerTimeout`;
- a worker that dies mid-call is replaced and the call raises `ScorerCrashed`; an exception
  inside the worker raises `ScorerError` carrying its class name; the pool keeps serving;
- at most `workers` items run at once; callers queue for an idle worker (the wait for a
  worker does not count against an item's timeout);
- data crosses the process boundary as length-prefixed orjson frames, never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from workers.reward.exceptions import ScorerCrashed, ScorerError, ScorerTimeout

__all__ = ["ScorerPool"]

log = logging.getLogger("rollout.reward.pool")

_LEN = struct.Struct(">I")
_REPO = Path(__file__).resolve().parents[2]


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def call(self, request: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None
        body = orjson.dumps(request)
        self.proc.stdin.write(_LEN.pack(len(body)) + body)
        await self.proc.stdin.drain()
        return await self.read()

    async def read(self) -> Any:
        assert self.proc.stdout is not None
        (size,) = _LEN.unpack(await self.proc.stdout.readexactly(_LEN.size))
        return orjson.loads(await self.proc.stdout.readexactly(size))

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


class ScorerPool:
    """A fixed number of scorer processes; `run()` an item on one of them."""

    def __init__(
        self,
        workers: int = 2,
        *,
        preload: tuple[str, ...] = ("math_verify",),
        start_timeout_s: float = 120.0,
    ) -> None:
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        self.size = workers
        self.preload = preload
        self.start_timeout_s = start_timeout_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._spawning: set[asyncio.Task[None]] = set()
        self._closed = False
        self.items = 0
        self.timeouts = 0
        self.crashes = 0
        self.errors = 0

    async def start(self) -> None:
        """Start every worker and wait until each has done its imports."""
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for worker in workers:
            self._idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
        env["ROLLOUT_POOL_PRELOAD"] = ",".join(self.preload)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "workers.reward.pool_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        worker = _Worker(proc)
        self._all.add(worker)
        try:
            ready = await asyncio.wait_for(worker.read(), self.start_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError) as exc:
            await self._discard(worker)
            raise ScorerCrashed(f"scorer worker did not start: {exc!r}") from exc
        if ready != {"ok": True, "result": "ready"}:
            await self._discard(worker)
            raise ScorerCrashed(f"scorer worker sent {ready!r} instead of ready")
        return worker

    async def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await worker.kill()

    def _replace(self, worker: _Worker) -> None:
        async def respawn() -> None:
            await self._discard(worker)
            if self._closed:
                return
            try:
                self._idle.put_nowait(await self._spawn())
            except ScorerCrashed:
                log.exception("could not replace a scorer worker; the pool is one smaller")

        task = asyncio.get_running_loop().create_task(respawn())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def run(self, fn: str, args: dict[str, Any], timeout_s: float) -> Any:
        """Run `fn(args)` in a worker; its result, or a `ScorerError` subclass."""
        if self._closed:
            raise RuntimeError("the scorer pool is closed")
        worker = await self._idle.get()
        started = time.monotonic()
        self.items += 1
        try:
            reply = await asyncio.wait_for(worker.call({"fn": fn, "args": args}), timeout_s)
        except TimeoutError:
            self.timeouts += 1
            self._replace(worker)
            raise ScorerTimeout(
                f"{fn} scorer exceeded {timeout_s:g}s; its worker was killed", timeout_s=timeout_s
            ) from None
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as exc:
            self.crashes += 1
            self._replace(worker)
            raise ScorerCrashed(f"{fn} scorer worker died: {exc!r}") from exc
        except asyncio.CancelledError:
            self._replace(worker)  # a reply may still come; this worker's stream is unusable
            raise
        self._idle.put_nowait(worker)
        log.debug("%s scored in %.3fs", fn, time.monotonic() - started)
        if not reply.get("ok"):
            self.errors += 1
            raise ScorerError(
                f"{fn} scorer raised {reply.get('error_class')}: {reply.get('message')}",
                error_class=reply.get("error_class"),
            )
        return reply.get("result")

    async def close(self) -> None:
        """Stop every worker (closing stdin ends them; stragglers are killed)."""
        self._closed = True
        for task in list(self._spawning):
            task.cancel()
        for worker in list(self._all):
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()
        for worker in list(self._all):
            try:
                await asyncio.wait_for(worker.proc.wait(), 2.0)
            except TimeoutError:
                await worker.kill()
        self._all.clear()

    async def __aenter__(self) -> ScorerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stats(self) -> dict[str, int]:
        return {
            "pool_items": self.items,
            "pool_timeouts": self.timeouts,
            "pool_crashes": self.crashes,
            "pool_errors": self.errors,
        }
