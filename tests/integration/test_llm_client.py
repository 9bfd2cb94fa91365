"""LLMClient against real HTTP: a deterministic in-process replica double, then real hf replicas.

`FakeReplica` is a real aiohttp server implementing the replica contract (workers/llm/contract.py)
with a token function that depends only on the sequence so far, so an interrupted and resumed
generation must equal an uninterrupted one token for token. It emits one token every few ms and
honours abort, pause/resume, update_weights (version tags), and can fail, hang, or be "killed"
(listener closed, in-flight connections dropped) and restarted on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pipeline.launch.replicas import wait_healthy
from tests.conftest import ROLLOUT
from workers.llm.client import LLMClient, LLMClientConfig
from workers.llm.exceptions import (
    BadRequestError,
    ClientClosedError,
    GenerationTimeoutError,
    NoReplicaError,
    RetriesExhaustedError,
)
from workers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def next_token(seq: Sequence[int]) -> int:
    return (sum(seq[-3:]) * 31 + len(seq) * 7) % 997 + 3


def logprob_of(tok: int) -> float:
    return -((tok % 10) + 1) / 10


def reference(prompt: Sequence[int], max_tokens: int, stop: Sequence[int] = ()) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        tok = next_token(seq)
        seq.append(tok)
        out.append(tok)
        if tok in stop:
            break
    return out


def _completion(rid: str, choice: dict[str, Any], version: int) -> web.Response:
    """The fake replica's completion response: one choice, tagged with its policy version."""
    body = {"id": rid, "created": 0, "model": "fake", "choices": [choice]}
    return web.json_response({**body, "policy_version": version})


class FakeReplica:
    """A deterministic test double of one replica (see module docstring)."""

    def __init__(self, replica_id: str, *, token_delay: float = 0.003, max_model_len: int = 4096):
        self.replica_id = replica_id
        self.token_delay = token_delay
        self.max_model_len = max_model_len
        self.version = 0
        self.fail_next: list[int] = []  # statuses returned (once each) by the next completions
        self.abort_next = 0  # the next completions end at once: "abort", no token
        self.hang = False
        self.killed = False
        self.bodies: list[dict[str, Any]] = []
        self.aborted_ids: list[str] = []
        self._resume = asyncio.Event()
        self._resume.set()
        self._running: dict[str, asyncio.Event] = {}
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/abort_requests", self.abort_requests)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_get("/is_paused", self.is_paused)
        app.router.add_post("/update_weights", self.update_weights)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        self.site: web.TCPSite | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeReplica:
        if not self.port:
            await self.runner.setup()
            self.port = free_port()
        self.killed = False
        self.site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await self.site.start()
        return self

    async def kill(self) -> None:
        """Like SIGKILL: stop listening and drop every in-flight request's connection."""
        self.killed = True
        if self.site is not None:
            await self.site.stop()
            self.site = None
        for ev in self._running.values():
            ev.set()
        assert self.runner.server is not None
        for conn in self.runner.server.connections:  # keep-alive ones too, as a dead process would
            conn.force_close()

    async def close(self) -> None:
        self.killed = True
        for ev in self._running.values():
            ev.set()
        self._resume.set()
        await self.runner.cleanup()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_next:
            status = self.fail_next.pop(0)
            return web.json_response(
                {"error": {"message": f"injected {status}", "type": "Injected"}}, status=status
            )
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        if len(prompt) + max_tokens > self.max_model_len:
            return web.json_response(
                {"error": {"message": "prompt past the context", "type": "BadRequestError"}},
                status=400,
            )
        await self._resume.wait()
        version, rid = self.version, body.get("request_id") or ""
        if self.abort_next:
            self.abort_next -= 1
            choice = {"token_ids": [], "finish_reason": "abort", "logprobs": {"token_logprobs": []}}
            return _completion(rid, choice, version)
        stop = set(body.get("stop_token_ids") or ())
        abort = self._running[rid] = asyncio.Event()
        seq, out, finish = list(prompt), [], "length"
        try:
            while len(out) < max_tokens:
                await asyncio.sleep(self.token_delay)
                while self.hang and not abort.is_set():
                    await asyncio.sleep(0.01)
                if abort.is_set():
                    if self.killed:
                        raise asyncio.CancelledError  # its connection is gone already
                    finish = "abort"
                    break
                tok = next_token(seq)
                seq.append(tok)
                out.append(tok)
                if tok in stop:
                    finish = "stop"
                    break
        finally:
            if self._running.get(rid) is abort:
                del self._running[rid]
        choice = {"token_ids": out, "finish_reason": finish}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"token_logprobs": [logprob_of(t) for t in out]}
        return _completion(rid, choice, version)

    async def abort_requests(self, request: web.Request) -> web.Response:
        ids = (await request.json())["request_ids"]
        self.aborted_ids.extend(ids)
        for rid in ids:
            if rid in self._running:
                self._running[rid].set()
        return web.json_response({"aborted": ids})

    async def pause(self, request: web.Request) -> web.Response:
        self._resume.clear()
        for ev in self._running.values():
            ev.set()
        return web.json_response({"paused": True})

    async def resume(self, request: web.Request) -> web.Response:
        self._resume.set()
        return web.json_response({"paused": False})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": not self._resume.is_set()})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self.pause(request)
        await asyncio.sleep(0.05)
        self.version = body["version"]
        self._resume.set()
        return web.json_response({"version": self.version})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": self.version})

    def running(self) -> int:
        return len(self._running)


FAST = {
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.05,
    "health_interval_s": 0.1,
    "health_timeout_s": 0.5,
    "no_replica_wait_s": 2.0,
    "max_total_time_s": 30.0,
}


@pytest.fixture
async def replicas() -> AsyncIterator[list[FakeReplica]]:
    reps = [await FakeReplica(f"fake{i}").start() for i in range(2)]
    yield reps
    for r in reps:
        await r.close()


@contextlib.asynccontextmanager
async def client_for(reps: Sequence[Any], **cfg: Any) -> AsyncIterator[LLMClient]:
    from workers.llm.balancer import Replica

    config = LLMClientConfig(**{**FAST, **cfg})
    async with LLMClient(config, [Replica(r.replica_id, r.address) for r in reps]) as client:
        yield client


async def when(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def post(address: str, path: str, body: dict[str, Any] | None = None) -> None:
    async with aiohttp.ClientSession() as s, s.post(address + path, json=body or {}) as resp:
        assert resp.status == 200, await resp.text()


PROMPT = [11, 12, 13, 14]


async def test_plain_generation(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas) as client:
        out = await client.generate("g1", PROMPT, {"max_tokens": 20})
        assert out.token_ids == reference(PROMPT, 20)
        assert out.logprobs == [logprob_of(t) for t in out.token_ids]
        assert (out.finish_reason, out.pieces, out.min_global_steps) == ("length", 1, 0)
        stop = reference(PROMPT, 20)[5]
        out = await client.generate("g2", PROMPT, {"max_tokens": 20, "stop_token_ids": [stop]})
        assert out.finish_reason == "stop" and out.token_ids == reference(PROMPT, 20, [stop])
        out = await client.generate("g3", PROMPT, {"max_tokens": 3, "logprobs": None})
        assert out.logprobs == [] and len(out.token_ids) == 3


async def test_pause_resume_in_the_middle(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas) as client:
        rep = pin(client, replicas, "p1")
        task = asyncio.create_task(client.generate("p1", PROMPT, {"max_tokens": 60}))
        await when(lambda: rep.running() == 1)
        await asyncio.sleep(0.05)
        await post(rep.address, "/pause")
        await asyncio.sleep(0.1)  # the resumed piece waits on the paused replica
        await post(rep.address, "/resume")
        out = await task
    assert out.token_ids == reference(PROMPT, 60) and out.finish_reason == "length"
    assert out.pieces >= 2 and set(out.replicas) == {rep.replica_id}
    first, second = rep.bodies[-2], rep.bodies[-1]
    done = len(second["prompt"]) - len(PROMPT)
    assert 0 < done < 60 and second["max_tokens"] == 60 - done and first["max_tokens"] == 60


async def test_a_seed_gives_every_sample_and_piece_its_own_stream(
    replicas: list[FakeReplica],
) -> None:
    """One configured seed must not make a prompt's n samples (or a resumed piece) n copies."""
    from workers.llm.client import piece_seed

    async with client_for(replicas) as client:
        rep = pin(client, replicas, "s/0")
        task = asyncio.create_task(client.generate("s/0", PROMPT, {"max_tokens": 60, "seed": 7}))
        await when(lambda: rep.running() == 1)
        await asyncio.sleep(0.05)
        await post(rep.address, "/abort_requests", {"request_ids": ["s/0"]})
        await task
        first, resumed = rep.bodies[-2], rep.bodies[-1]
        await client.generate("s/1", PROMPT, {"max_tokens": 5, "seed": 7})
    other = next(b for r in replicas for b in r.bodies if b["request_id"] == "s/1")
    seeds = [first["seed"], resumed["seed"], other["seed"]]
    assert len(set(seeds)) == 3
    assert first["seed"] == piece_seed(7, "s/0", len(PROMPT))
    assert resumed["seed"] == piece_seed(7, "s/0", len(resumed["prompt"]))
    assert other["seed"] == piece_seed(7, "s/1", len(PROMPT)) != piece_seed(8, "s/1", len(PROMPT))


async def test_update_weights_in_the_middle_spans_two_versions(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas) as client:
        rep = pin(client, replicas, "u1")
        task = asyncio.create_task(client.generate("u1", PROMPT, {"max_tokens": 60}))
        await when(lambda: rep.running() == 1)
        await asyncio.sleep(0.05)
        await post(rep.address, "/update_weights", {"path": "/nowhere", "version": 3})
        out = await task
    assert out.token_ids == reference(PROMPT, 60)
    assert (out.min_global_steps, out.max_global_steps) == (0, 3)


async def test_explicit_abort_is_resumed(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas) as client:
        rep = pin(client, replicas, "a1")
        task = asyncio.create_task(client.generate("a1", PROMPT, {"max_tokens": 50}))
        await when(lambda: rep.running() == 1)
        await asyncio.sleep(0.04)
        await post(rep.address, "/abort_requests", {"request_ids": ["a1"]})
        out = await task
    assert out.token_ids == reference(PROMPT, 50) and out.pieces == 2
    assert client.counters["resumes"] == 1


async def test_kill_in_the_middle_finishes_on_the_other(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas) as client:
        victim = pin(client, replicas, "k1")
        task = asyncio.create_task(client.generate("k1", PROMPT, {"max_tokens": 80}))
        other = next(r for r in replicas if r is not victim)
        await when(lambda: victim.running() == 1)
        await asyncio.sleep(0.03)
        await post(victim.address, "/abort_requests", {"request_ids": ["k1"]})  # a piece boundary
        await when(lambda: len(victim.bodies) == 2 and victim.running() == 1)
        await asyncio.sleep(0.03)
        await victim.kill()
        out = await task
        assert out.token_ids == reference(PROMPT, 80), out
        assert out.replicas[0] == victim.replica_id and out.replicas[-1] == other.replica_id
        kept = len(other.bodies[-1]["prompt"]) - len(PROMPT)
        assert kept > 0  # tokens of the piece before the kill were not regenerated
        assert not client.balancer.get(victim.replica_id).routable  # type: ignore[union-attr]
        await victim.start()  # back on the same port: the health loop re-adds it
        await when(lambda: client.balancer.get(victim.replica_id).routable)  # type: ignore[union-attr]


async def test_health_loop_drops_after_k_failures_and_readds(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas, health_failures=2, health_interval_s=0.05) as client:
        await replicas[0].kill()
        await when(lambda: [r.replica_id for r in client.balancer.routable()] == ["fake1"])
        assert client.health.consecutive["fake0"] >= 2
        await replicas[0].start()
        await when(lambda: len(client.balancer.routable()) == 2)


async def test_server_error_retried_bad_request_not(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas[:1]) as client:
        replicas[0].fail_next = [503, 500]
        out = await client.generate("e1", PROMPT, {"max_tokens": 5})
        assert out.token_ids == reference(PROMPT, 5) and client.counters["failures"] == 2
        replicas[0].fail_next = [422]
        with pytest.raises(BadRequestError, match="injected 422") as err:
            await client.generate("e2", PROMPT, {"max_tokens": 5})
        assert err.value.status == 422 and err.value.error_type == "Injected"
        n = len(replicas[0].bodies)
        with pytest.raises(BadRequestError, match="past the context"):
            await client.generate("e3", PROMPT, {"max_tokens": 5000})
        assert len(replicas[0].bodies) == n + 1  # not retried


async def test_retries_exhausted(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas[:1], max_retries=2) as client:
        replicas[0].fail_next = [500] * 10
        with pytest.raises(RetriesExhaustedError) as err:
            await client.generate("x1", PROMPT, {"max_tokens": 5})
    assert err.value.last_error is not None and "injected 500" in str(err.value.last_error)
    assert len(replicas[0].bodies) == 3


async def test_aborts_without_tokens_are_resumed_but_bounded(replicas: list[FakeReplica]) -> None:
    """Weight updates abort requests; when they come faster than a request finishes, a
    request can be aborted many times in a row without a token: not a failure."""
    async with client_for(replicas[:1], max_retries=1, max_idle_aborts=8) as client:
        replicas[0].abort_next = 8
        out = await client.generate("ab1", PROMPT, {"max_tokens": 5})
        assert out.token_ids == reference(PROMPT, 5)
        assert client.counters["aborts"] == 8 and client.counters["failures"] == 0
        replicas[0].abort_next = 20
        with pytest.raises(RetriesExhaustedError, match="9 aborts in a row"):
            await client.generate("ab2", PROMPT, {"max_tokens": 5})


async def test_timeout_aborts_and_moves_on(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas, request_timeout_s=0.3) as client:
        slow = pin(client, replicas, "t1")
        slow.hang = True
        # the hung replica still answers /health, so the retry stays sticky there; stop it
        task = asyncio.create_task(client.generate("t1", PROMPT, {"max_tokens": 10}))
        await when(lambda: "t1" in slow.aborted_ids, timeout=5)
        client.balancer.mark_unhealthy(slow.replica_id)
        slow.hang = False
        out = await task
    assert out.token_ids == reference(PROMPT, 10)


async def test_no_replica_waits_then_fails_or_proceeds(replicas: list[FakeReplica]) -> None:
    async with client_for([], no_replica_wait_s=0.2) as client:
        with pytest.raises(NoReplicaError):
            await client.generate("n1", PROMPT, {"max_tokens": 3})
    async with client_for([], no_replica_wait_s=5) as client:
        task = asyncio.create_task(client.generate("n2", PROMPT, {"max_tokens": 3}))
        await asyncio.sleep(0.1)
        client.add_replicas([replicas[1].address])
        out = await task
        assert out.replicas == [replicas[1].address]


async def test_wall_time_cap(replicas: list[FakeReplica]) -> None:
    replicas[0].token_delay = 0.02
    async with client_for(replicas[:1], max_total_time_s=0.3) as client:
        with pytest.raises(GenerationTimeoutError):
            await client.generate("w1", PROMPT, {"max_tokens": 100})
    await when(lambda: "w1" in replicas[0].aborted_ids)


async def test_cancel_aborts_on_the_replica(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas[:1]) as client:
        task = asyncio.create_task(client.generate("c1", PROMPT, {"max_tokens": 500}))
        await when(lambda: replicas[0].running() == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await when(lambda: replicas[0].running() == 0)
        assert replicas[0].aborted_ids == ["c1"]
        assert client.balancer.inflight("fake0") == 0


async def test_many_concurrent_with_pause_storm(replicas: list[FakeReplica]) -> None:
    async with client_for(replicas) as client:
        ids = [f"m{i}" for i in range(40)]
        tasks = [
            asyncio.create_task(client.generate(i, [n + 1, 2, 3], {"max_tokens": 30}))
            for n, i in enumerate(ids)
        ]
        await asyncio.sleep(0.03)
        for r in replicas:
            await post(r.address, "/update_weights", {"path": "/x", "version": 1})
        outs = await asyncio.gather(*tasks)
        assert all(client.balancer.inflight(r.replica_id) == 0 for r in replicas)
    for n, out in enumerate(outs):
        assert out.token_ids == reference([n + 1, 2, 3], 30)
        assert out.max_global_steps == 1
    per = [sum(1 for o in outs if o.replicas[0] == r.replica_id) for r in replicas]
    assert min(per) >= 15  # least in-flight spreads the load


async def test_closed_client_refuses(replicas: list[FakeReplica]) -> None:
    client = LLMClient(LLMClientConfig(**FAST), [replicas[0].address])
    with pytest.raises(ClientClosedError):
        await client.generate("z", PROMPT)
    await client.start()
    await client.close()
    with pytest.raises(ClientClosedError):
        await client.generate("z", PROMPT)


def test_config_and_error_tree() -> None:
    from pydantic import ValidationError

    from schemas.errors import RolloutError
    from workers.llm import exceptions

    with pytest.raises(ValidationError, match="backoff_max_s"):
        LLMClientConfig(backoff_initial_s=2.0, backoff_max_s=1.0)
    with pytest.raises(ValidationError):
        LLMClientConfig(max_retires=3)
    for name in exceptions.__all__:
        obj = getattr(exceptions, name)
        if isinstance(obj, type):
            assert issubclass(obj, RolloutError)
    assert not set(exceptions.RETRYABLE_ERRORS) & {BadRequestError, NoReplicaError}


def pin(client: LLMClient, reps: Sequence[FakeReplica], request_id: str) -> FakeReplica:
    """Route `request_id` once, so its generation goes (sticky) to the returned replica."""
    rep = client.balancer.acquire(request_id)
    client.balancer.release(rep, request_id)
    return next(r for r in reps if r.replica_id == rep.replica_id)


# ---- end to end: two real `hf` CPU replicas (subprocesses) ------------------------------------

GREEDY = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}


class HfProc:
    def __init__(self, model: Path, replica_id: str, log: Path) -> None:
        self.model, self.replica_id, self.log = model, replica_id, log
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [*ROLLOUT, "replica", "serve", "--backend", "hf", "--model", str(self.model)]
        cmd += ["--port", str(self.port), "--replica-id", self.replica_id, "--threads", "1"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)

    def wait_ready(self, timeout: float = 240.0) -> None:
        alive = lambda: self.proc is not None and self.proc.poll() is None  # noqa: E731
        wait_healthy(self.address, alive, timeout, name=self.replica_id, log=self.log)

    async def running(self) -> int:
        return int((await self.info())["running"])

    async def waiting(self) -> int:
        return int((await self.info())["waiting"])

    async def info(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.address + "/info") as resp:
            return dict(await resp.json())

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture(scope="module")
def hf_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[HfProc]]:
    from pipeline.harness.models.tiny import init_model

    base = tmp_path_factory.mktemp("hf")
    model = init_model(base / "model", preset="tiny", seed=0)
    procs = [HfProc(model, f"hf{i}", base / f"hf{i}.log") for i in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def spy_pieces(client: LLMClient) -> list[tuple[str, int, list[int], str]]:
    """Record (replica, prompt length, tokens, finish) of every piece that got an answer."""
    seen: list[tuple[str, int, list[int], str]] = []
    orig = client._complete

    async def spy(rep: Any, body: dict[str, Any], left: float) -> Any:
        n = len(body["prompt"])
        version, choice = await orig(rep, body, left)
        seen.append((rep.replica_id, n, list(choice.token_ids), choice.finish_reason))
        return version, choice

    client._complete = spy  # type: ignore[method-assign]
    return seen


async def _start_and_wait(client: LLMClient, procs: list[HfProc], rid: str) -> tuple[Any, HfProc]:
    pinned = client.balancer.acquire(rid)
    client.balancer.release(pinned, rid)
    proc = next(p for p in procs if p.replica_id == pinned.replica_id)
    task = asyncio.create_task(client.generate(rid, [1, 5, 9, 200, 300], GREEDY))
    end = time.monotonic() + 60
    while await proc.running() < 1:
        assert time.monotonic() < end and not task.done()
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    return task, proc


@pytest.mark.slow
async def test_hf_pause_resume_and_update_weights(hf_replicas: list[HfProc]) -> None:
    async with client_for(hf_replicas) as client:
        pieces = spy_pieces(client)
        task, proc = await _start_and_wait(client, hf_replicas, "hf-pause")
        await post(proc.address, "/pause")
        await asyncio.sleep(0.3)
        await post(proc.address, "/resume")
        out = await task
        assert (len(out.token_ids), out.finish_reason) == (GREEDY["max_tokens"], "length")
        assert out.pieces >= 2 and out.pieces == len(pieces)
        assert out.token_ids[: len(pieces[0][2])] == pieces[0][2]

        task, proc = await _start_and_wait(client, hf_replicas, "hf-update")
        model = str(hf_replicas[0].model)
        await post(proc.address, "/update_weights", {"path": model, "version": 1})
        out = await task
        assert len(out.token_ids) == GREEDY["max_tokens"] and out.pieces >= 2
        assert (out.min_global_steps, out.max_global_steps) == (0, 1)


@pytest.mark.slow
async def test_hf_sigkill_in_the_middle_finishes_on_the_other(hf_replicas: list[HfProc]) -> None:
    async with client_for(hf_replicas, request_timeout_s=120) as client:
        pieces = spy_pieces(client)
        task, victim = await _start_and_wait(client, hf_replicas, "hf-kill")
        # Pausing aborts the running piece (its tokens come back) and holds the re-sent rest
        # in the victim's queue, so the kill always lands while the victim owns the request.
        # (Killing a fixed time after a resume raced the resumed piece: on a fast machine it
        # could finish on the victim first.)
        await post(victim.address, "/pause")
        end = time.monotonic() + 60
        while not (pieces and await victim.waiting() == 1):
            assert time.monotonic() < end and not task.done()
            await asyncio.sleep(0.02)
        victim.kill()
        out = await task
    before = pieces[0][2]
    assert pieces[0][0] == victim.replica_id and pieces[0][3] == "abort" and before
    assert out.token_ids[: len(before)] == before  # tokens from before the kill are kept
    assert out.replicas[-1] != victim.replica_id
    assert (len(out.token_ids), out.finish_reason) == (GREEDY["max_tokens"], "length")
