"""The LLM client: one `generate` call = one complete generation, however often it is interrupted.

Contract (what an agent loop may rely on):
    `await client.generate(request_id, prompt_ids, sampling_params) -> GenerateOutput` returns only
    after a real finish (`stop`, or `length` once `max_tokens` is spent, or the replica's own
    `length` at its context limit). A piece that ends with `abort` (pause for a weight update,
    an explicit abort) or a replica that fails (connection error, 5xx, timeout, broken response)
    is resumed: prompt + tokens so far are re-sent with the remaining token budget, on the same
    replica while it is healthy (sticky by `request_id`), else on another. Tokens and logprobs of
    every piece are concatenated in order; `min/max_global_steps` are the min/max policy versions
    of the pieces that produced tokens.

Retry policy:
    - aborts that made progress, or came while the replica is paused: resumed without limit;
    - failures: at most `max_retries` in a row (a piece that produces tokens resets the
      count), with exponential backoff and jitter; a failed request is followed by a `/health`
      probe of its replica, which is dropped from routing at once if the probe fails too;
    - aborts without progress on an unpaused replica (a weight update landed between the
      request and the pause probe): resumed, at most `max_idle_aborts` in a row;
    - 4xx: never retried, `BadRequestError` with the server's message;
    - every generation is capped at `max_total_time_s` of wall time (`GenerationTimeoutError`).

Replicas join and leave at run time (`add_replicas` / `remove_replicas`, fed later from the
`rl.replicas` topic). A client routes to one role of replica (`role`: `policy` for the agent
loops, `judge` for the reward stage's judge): a `ReplicaInfo` of another role is never added
(the balancer refuses it); a bare URL is taken as the client's own role. A background task
probes `/health` of every known replica every `health_interval_s` (`workers.llm.health`):
`health_failures` consecutive failures take a replica out of routing, one success brings it
back. Cancelling a `generate` aborts its request
on the replica (best effort).

Routed experts (`return_routed_experts`, MoE models): every piece asks for the routing of the
positions it fed, from position 0; the generation keeps the first piece's and appends from each
later piece only the positions past what it holds (`RoutedExperts.extended_by`), so tokens
generated under an earlier policy version keep the routing recorded then. Only pieces that
produced tokens (or finished) count, as for the tokens themselves; a piece whose routing does
not cover exactly its context + tokens − 1 positions breaks the contract (a failure, retried).

Seeds: a `seed` in the sampling params seeds the whole generation, not each request alike.
Every piece is sent with `piece_seed(seed, request_id, context length)`, so the n samples of
a prompt (distinct request ids), the turns of one trajectory and the pieces of a resumed
generation each draw their own stream, and a rerun of the same run draws the same ones.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp
import orjson
from pydantic import ValidationError

from schemas.events import ReplicaRole
from schemas.media import ImageRef
from workers.llm.balancer import Balancer, Replica
from workers.llm.config import LLMClientConfig
from workers.llm.contract import (
    CAPACITY_HEADER,
    LOAD_HEADER,
    CompletionChoice,
    CompletionResponse,
    GenerateOutput,
    SamplingParams,
)
from workers.llm.exceptions import (
    RETRYABLE_ERRORS,
    BadRequestError,
    ClientClosedError,
    GenerationTimeoutError,
    NoReplicaError,
    ReplicaError,
    ReplicaServerError,
    ReplicaTimeoutError,
    ReplicaUnavailableError,
)
from workers.llm.health import HealthChecker
from workers.llm.progress import Progress, routing_problem

__all__ = ["ClientState", "LLMClient", "LLMClientConfig", "ReplicaLike", "piece_seed"]

logger = logging.getLogger("rollout.llm.client")
_JSON = {"Content-Type": "application/json"}


class _ReplicaInfoLike(Protocol):
    replica_id: str
    address: str
    version: int
    role: ReplicaRole


ReplicaLike = Replica | _ReplicaInfoLike | str
"""A `Replica`, a `schemas.ReplicaInfo` (from `rl.replicas`), or a base URL (used as its id)."""


class ClientState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


def _to_replica(item: ReplicaLike, role: ReplicaRole) -> Replica:
    """`item` as a `Replica`; a bare URL is one of `role` (whoever names it knows)."""
    if isinstance(item, Replica):
        return item
    if isinstance(item, str):
        return Replica(item.rstrip("/"), item, role=role)
    return Replica(item.replica_id, item.address, item.version, role=item.role)


def _error_message(raw: bytes) -> tuple[str, str]:
    try:
        err = orjson.loads(raw)["error"]
        return str(err.get("message", "")), str(err.get("type", ""))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return raw[:500].decode(errors="replace"), ""


class LLMClient:
    """Resumable generation over a changing set of replicas. Use as `async with LLMClient(...)`."""

    def __init__(
        self,
        config: LLMClientConfig | None = None,
        replicas: Iterable[ReplicaLike] = (),
        *,
        role: ReplicaRole = "policy",
    ) -> None:
        """`role`: the replicas this client routes to (the others are never added)."""
        self.config = config or LLMClientConfig()
        self.balancer = Balancer(
            sticky_size=self.config.sticky_size,
            deterministic=self.config.deterministic,
            routing=self.config.routing,
            load_ttl_s=self.config.load_ttl_s,
            role=role,
        )
        self.state = ClientState.NEW
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # request id -> (load, capacity) reported on its last response (capacity None: unsaid)
        self._loads: dict[str, tuple[int, int | None]] = {}
        self._routable = asyncio.Event()
        self.health = HealthChecker(
            self.balancer,
            timeout_s=self.config.health_timeout_s,
            failures=self.config.health_failures,
            on_routable=self._routable.set,
        )
        self.counters: dict[str, int] = dict.fromkeys(
            ("generations", "pieces", "resumes", "failures", "aborts"), 0
        )
        self.add_replicas(replicas)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> LLMClient:
        if self.state is not ClientState.NEW:
            raise ClientClosedError(f"client is {self.state.value}; create a new one")
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.max_connections),
            timeout=aiohttp.ClientTimeout(
                total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s
            ),
        )
        self.health.session = self._session
        self.state = ClientState.OPEN
        self._health_task = asyncio.create_task(
            self.health.run(cfg.health_interval_s), name="llm-client-health"
        )
        return self

    async def close(self) -> None:
        if self.state is ClientState.CLOSED:
            return
        self.state = ClientState.CLOSED
        tasks = [t for t in (self._health_task, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> LLMClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- membership --------------------------------------------------------------------------

    def add_replicas(self, replicas: Iterable[ReplicaLike]) -> list[Replica]:
        added = self.balancer.add_replicas(_to_replica(r, self.balancer.role) for r in replicas)
        if self.balancer.routable():
            self._routable.set()
        return added

    def remove_replicas(self, replicas: Iterable[ReplicaLike]) -> list[Replica]:
        ids = [r if isinstance(r, str) else r.replica_id for r in replicas]
        for rid in ids:
            self.health.forget(rid)
        return self.balancer.remove_replicas(ids)

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool | None = None,
        images: Sequence[ImageRef] = (),
    ) -> GenerateOutput:
        """Generate until a real finish, resuming across aborts and replica failures.
        `return_routed_experts`: None reads the config's (module docstring). `images`: the
        prompt's, bytes inline (`contract`), sent with every piece."""
        if self.state is not ClientState.OPEN:
            raise ClientClosedError(f"client is {self.state.value}")
        params = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else SamplingParams.model_validate(sampling_params or {})
        )
        body = params.model_dump()
        routed = bool(
            self.config.return_routed_experts
            if return_routed_experts is None
            else return_routed_experts
        )
        if routed:
            body["return_routed_experts"] = True
        if images:
            body["images"] = [ref.model_dump(mode="json") for ref in images]
        budget = params.max_tokens
        want_logprobs = params.logprobs is not None
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.max_total_time_s
        got = Progress()
        failures = idle_aborts = 0
        last_error: BaseException | None = None
        self.counters["generations"] += 1
        while True:
            if self.state is not ClientState.OPEN:
                raise ClientClosedError(f"{request_id}: client closed during generation")
            remaining = budget - len(got.tokens)
            if remaining <= 0:
                return got.output("length")
            if loop.time() >= deadline:
                raise GenerationTimeoutError(
                    f"{request_id}: over max_total_time_s={cfg.max_total_time_s}",
                    partial=got.output("abort"),
                )
            rep = await self._acquire(request_id, deadline, got)
            try:
                body.update(
                    prompt=[*prompt_ids, *got.tokens], max_tokens=remaining, request_id=request_id
                )
                if params.seed is not None:
                    context = len(prompt_ids) + len(got.tokens)
                    body["seed"] = piece_seed(params.seed, request_id, context)
                version, choice = await self._complete(rep, body, deadline - loop.time())
            except RETRYABLE_ERRORS as exc:
                failures += 1
                last_error = exc
                self.counters["failures"] += 1
                logger.warning(
                    "generate %s: %s on replica %s (failure %d/%d): %s",
                    request_id,
                    type(exc).__name__,
                    rep.replica_id,
                    failures,
                    cfg.max_retries,
                    exc,
                )
            else:
                got.pieces += 1
                self.counters["pieces"] += 1
                got.replicas.append(rep.replica_id)
                got.last_version = version
                n = len(choice.token_ids)
                lps = (choice.logprobs or {}).get("token_logprobs", []) if want_logprobs else []
                progress = bool(n) or choice.finish_reason != "abort"
                broken = routing_problem(choice, len(body["prompt"]), routed and progress)
                if (want_logprobs and len(lps) != n) or broken:
                    failures += 1
                    last_error = ReplicaServerError(
                        broken or f"{len(lps)} logprobs for {n} tokens", replica_id=rep.replica_id
                    )
                elif progress:
                    got.add(choice, version, lps, routed=routed)
                    if n:
                        failures = idle_aborts = 0  # progress: only failures in a row count
                    if choice.finish_reason != "abort":
                        return got.output(choice.finish_reason)
                    self.counters["resumes"] += 1
                    logger.debug("generate %s: resumed after abort with %d tokens", request_id, n)
                    continue
                else:
                    self.counters["aborts"] += 1
                    if await self.health.is_paused(rep):
                        # a paused replica holds the re-sent request until resume; the short
                        # sleep only guards against a backend that aborts waiting requests too
                        await asyncio.sleep(cfg.backoff_initial_s)
                        continue
                    # Not a failure: a replica loading weights aborts what it runs, and the
                    # trainer may publish faster than a request finishes. Bounded apart.
                    idle_aborts += 1
                    if idle_aborts > cfg.max_idle_aborts:
                        raise got.exhausted(
                            f"{request_id}: {idle_aborts} aborts in a row without a token "
                            f"(max_idle_aborts={cfg.max_idle_aborts})",
                            last_error=None,
                        )
                    await asyncio.sleep(cfg.backoff_initial_s)
                    continue
            finally:
                # with the load the replica reported on this response, if it made one
                load, capacity = self._loads.pop(request_id, (None, None))
                self.balancer.release(rep, request_id, load=load, capacity=capacity)
            if failures > cfg.max_retries:
                raise got.exhausted(
                    f"{request_id}: {failures} failures (max_retries={cfg.max_retries}); "
                    f"last: {last_error!r}",
                    last_error=last_error,
                ) from last_error
            if isinstance(last_error, ReplicaError):
                await self.health.check_after_failure(rep)
            delay = min(
                cfg.backoff_max_s, cfg.backoff_initial_s * cfg.backoff_multiplier ** (failures - 1)
            )
            delay *= 1.0 + cfg.backoff_jitter * random.random()
            await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))

    async def _acquire(self, request_id: str, deadline: float, got: Progress) -> Replica:
        loop = asyncio.get_running_loop()
        until = min(deadline, loop.time() + self.config.no_replica_wait_s)
        while True:
            try:
                return self.balancer.acquire(request_id)
            except NoReplicaError:
                left = until - loop.time()
                if left <= 0:
                    known = [r.replica_id for r in self.balancer.replicas()]
                    raise NoReplicaError(
                        f"{request_id}: no routable replica within "
                        f"{self.config.no_replica_wait_s}s (known, all unhealthy: {known}); "
                        f"{len(got.tokens)} tokens so far"
                    ) from None
                self._routable.clear()
                try:
                    await asyncio.wait_for(self._routable.wait(), left)
                except TimeoutError:
                    pass

    async def _complete(
        self, rep: Replica, body: dict[str, Any], time_left: float
    ) -> tuple[int, CompletionChoice]:
        """One HTTP request; maps every transport problem onto the exception tree. The load the
        replica reported (`LOAD_HEADER`, `CAPACITY_HEADER`) waits in `_loads` for the request's
        `release`."""
        assert self._session is not None
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=max(0.001, min(cfg.request_timeout_s, time_left)),
            sock_connect=cfg.connect_timeout_s,
        )
        rid = body.get("request_id", "")
        try:
            async with self._session.post(
                f"{rep.address}/v1/completions",
                data=orjson.dumps(body),
                headers=_JSON,
                timeout=timeout,
            ) as resp:
                raw = await resp.read()
                status = resp.status
                reported = resp.headers.get(LOAD_HEADER, "")
                capacity = resp.headers.get(CAPACITY_HEADER, "")
        except TimeoutError as exc:
            self._abort_soon(rep, rid)
            raise ReplicaTimeoutError(
                f"no answer in {timeout.total:.1f}s", replica_id=rep.replica_id
            ) from exc
        except aiohttp.ClientError as exc:
            raise ReplicaUnavailableError(
                f"{type(exc).__name__}: {exc}", replica_id=rep.replica_id
            ) from exc
        except asyncio.CancelledError:
            self._abort_soon(rep, rid)
            raise
        if status == 200:
            try:
                out = CompletionResponse.model_validate_json(raw)
                if reported.isdigit():
                    self._loads[rid] = (
                        int(reported),
                        int(capacity) if capacity.isdigit() else None,
                    )
                return out.policy_version, out.choices[0]
            except (ValidationError, IndexError) as exc:
                raise ReplicaServerError(
                    f"response breaks the contract: {exc}", replica_id=rep.replica_id, status=status
                ) from exc
        message, error_type = _error_message(raw)
        if status >= 500 or status in (408, 429):
            raise ReplicaServerError(message, replica_id=rep.replica_id, status=status)
        raise BadRequestError(
            message, status=status, error_type=error_type, replica_id=rep.replica_id
        )

    async def check_health(self) -> dict[str, bool]:
        """Probe every known replica once and update routing; returns replica id -> healthy."""
        return await self.health.check_all()

    def _abort_soon(self, rep: Replica, request_id: str) -> None:
        """Best effort: tell the replica to stop a request we no longer wait for."""
        if not request_id or self._session is None or self._session.closed:
            return

        async def abort() -> None:
            assert self._session is not None
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
                payload = orjson.dumps({"request_ids": [request_id]})
                async with self._session.post(
                    f"{rep.address}/abort_requests", data=payload, headers=_JSON, timeout=timeout
                ):
                    pass
            except (aiohttp.ClientError, TimeoutError):
                logger.debug("abort of %s on %s failed", request_id, rep.replica_id)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def piece_seed(seed: int, request_id: str, context_length: int) -> int:
    """The seed of one request: distinct per (request id, context length), a 31-bit int."""
    digest = hashlib.blake2b(
        f"{seed}\x00{request_id}\x00{context_length}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
