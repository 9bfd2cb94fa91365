"""Hybrid lending: the idle trainer serves generation from its live policy, and takes it back.

`Lender` runs an `hf` replica (`workers.llm.engines.hf.server`) on the trainer's own model object
(no copy, no weight sync: the replica's version *is* the trainer's) in a thread of the trainer
process, with its own asyncio loop. The trainer calls `tend(ready, version, queued)` right
after each step (before it publishes the new version) and while it collects a batch, and
`training()` around each optimiser step:

- `tend` lends while fewer than `reclaim_ratio * train_batch_size` groups are ready, counting
  those already waiting on the replay topic (`queued`, asked only when a lend is in question):
  with enough waiting the trainer does not wait, and a lend shorter than the routers take to
  add it (their `rl.replicas` follower: ~0.1-0.5 s) serves nothing; requests that reach it
  after the withdrawal get 503s (`lend_action`). Lending means: the engine is told the
  trainer's version (prefix cache dropped: the weights changed in place), resumed, and a
  `ReplicaInfo` is published on `rl.replicas` (acknowledged), so the routers add it. The
  trainer tends right after a step, before it publishes the version: the routers add the
  lent engine while the replicas load the new weights, so it is routable when the staleness
  gate admits the batch that version frees (with `max_staleness` 0, the whole batch at once).
- Once that many groups are ready (and always before a step) it *withdraws*: a tombstone on
  `rl.replicas` (acknowledged; the routers drop the id atomically), then the replica answers
  503 to completions and `/health` (a sticky client that resumes there fails over and drops
  it), then `pause()` aborts what the engine runs and holds what is queued: each aborted piece
  returns its tokens with finish `abort`, and the LLM client resumes it on another replica,
  invisibly to the agent loop, tagged with the versions its pieces spanned.
- `training()` withdraws, waits until nothing runs on the engine, and checks from the engine's
  own counter that no token was generated while the optimiser step ran (`LendingError`
  otherwise): the engine thread only forwards between its commands, and a paused engine with
  no running row does none, so the step never races a forward over the weights it mutates.
  The engine thread runs under `torch.inference_mode`, so its forwards record no graph.

Counters (`counters()`, also written to the step log as `event: lend` after every step):
`lends`, `withdrawals`, `declined` (collections that did not lend: enough groups waiting),
`completions` answered (`finished`: those not aborted),
`generated_tokens`, `tokens_during_steps`
(must stay 0), `running_at_steps` (rows on the engine when a step started; must stay 0),
`aborted_with_tokens` ([request id, version] of the pieces withdrawals aborted after they had
sampled tokens since the last record: the generations resumed elsewhere).

One trainer process only: a sharded (FSDP2) policy forwards only with every rank together
(`TrainerConfig` refuses `lend` with `nproc > 1`).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from aiohttp import web
from kafka.errors import KafkaError

from schemas.codec import encode, headers_for
from schemas.events import ReplicaInfo
from workers.kafka.clients import ack_wait_s
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.ports import check_reachable, routable_ip
from workers.trainer.config import LENT_REPLICA_PREFIX, LendConfig
from workers.trainer.exceptions import TrainerError

__all__ = ["LendState", "Lender", "LendingError", "lend_action", "reclaim_threshold"]

log = logging.getLogger("rollout.trainer.lend")

T = TypeVar("T")


class LendingError(TrainerError):
    """The lent engine ran while the trainer trained, or could not be lent or withdrawn."""


class LendState(enum.Enum):
    WITHDRAWN = "withdrawn"
    LENT = "lent"
    CLOSED = "closed"


def reclaim_threshold(ratio: float, train_batch_size: int) -> int:
    """Groups ready at which the trainer withdraws: `ceil(ratio * batch)`, at least 1 (with
    none ready it always lends) and at most the batch (then it trains)."""
    return min(train_batch_size, max(1, math.ceil(ratio * train_batch_size - 1e-9)))


def lend_action(
    ready: int, queued: Callable[[], int], threshold: int, *, lent: bool
) -> Literal["lend", "withdraw", "decline"] | None:
    """What `tend` does with `ready` groups collected: withdraw once they reach `threshold`;
    while withdrawn, lend unless the groups already waiting on the topic (`queued()`, asked
    only then) would reach it too (`decline`); None: nothing to do."""
    if ready >= threshold:
        return "withdraw" if lent else None
    if lent:
        return None
    return "lend" if ready + queued() < threshold else "decline"


class Lender:
    """The trainer's lent replica; see the module docstring."""

    def __init__(
        self,
        config: LendConfig,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        producer: Any,
        *,
        model: Any,
        model_dir: str,
        version: int,
        threads: int,
        train_batch_size: int,
    ) -> None:
        self.config, self.kafka, self.topics, self.producer = config, kafka, topics, producer
        self.model, self.model_dir, self.threads = model, model_dir, threads
        self.threshold = reclaim_threshold(config.reclaim_ratio, train_batch_size)
        self.state = LendState.WITHDRAWN
        self.counts = {"lends": 0, "withdrawals": 0, "declined": 0, "tokens_during_steps": 0}
        self._declined_at = -1  # the version a collection last declined to lend at
        self.counts["running_at_steps"] = 0
        self.counts["finished"] = 0  # pieces that ended here (stop or length), not aborted
        self.resumed: list[tuple[str, int]] = []  # aborted pieces with tokens, not yet reported
        self._withdrawn = True  # read by the app's middleware (its loop's thread)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lent", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self.app, self.address = self._run(self._start(version))
        self.replica_id = f"{LENT_REPLICA_PREFIX}-{self._runner.addresses[0][1]}"  # type: ignore[union-attr]
        log.info("lent replica %s ready at %s (not lent yet)", self.replica_id, self.address)

    # --- the trainer's side -------------------------------------------------------------

    def tend(self, ready: int, version: int, queued: Callable[[], int] = lambda: 0) -> None:
        """Lend while fewer than `threshold` groups are `ready`, even with the `queued` ones
        (groups on the topic not collected yet); withdraw once enough are ready. Declined
        once at `version`, the rest of that collection is declined without asking `queued`
        again (a request to the broker per group): what waited is collected, not gone."""
        if self._declined_at == version and self.state is LendState.WITHDRAWN:
            return
        action = lend_action(ready, queued, self.threshold, lent=self.state is LendState.LENT)
        if action == "withdraw":
            self.withdraw()
        elif action == "lend":
            self.lend(version)
        elif action == "decline":
            self._declined_at = version  # counted once per collection
            self.counts["declined"] += 1
            log.debug("not lent at version %d: enough groups are waiting", version)

    def lend(self, version: int) -> None:
        """Serve generation at `version` (the trainer's weights as they are now)."""
        if self.state is not LendState.WITHDRAWN:
            return
        engine = self.engine
        self.model.eval()  # no dropout in sampling; the next step sets train mode again
        if engine.version != version:  # weights changed in place: abort nothing, drop the KV
            self._run(engine.load_weights(lambda _live: {}, version))
        self._withdrawn = False
        self._run(engine.resume())
        info = ReplicaInfo(
            replica_id=self.replica_id,
            address=self.address,
            backend="hf",
            model=self.model_dir,
            version=version,
        )
        self._send(info.replica_id, encode(info), headers_for(info))
        self.state = LendState.LENT
        self.counts["lends"] += 1
        log.info("lent replica %s at version %d", self.replica_id, version)

    def withdraw(self) -> None:
        """Tombstone, refuse new work, abort what runs (resumed elsewhere by the clients)."""
        if self.state is not LendState.LENT:
            return
        self._send(self.replica_id, None, [])
        self._withdrawn = True
        self._run(self.engine.pause())
        self.state = LendState.WITHDRAWN
        self.counts["withdrawals"] += 1
        log.info("withdrew lent replica %s", self.replica_id)

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around one optimiser step: withdrawn, idle, and no token generated meanwhile."""
        self.withdraw()
        engine = self.engine
        deadline = time.monotonic() + 30
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.005)  # a paused engine finishes the step it is in, then idles
        self.counts["running_at_steps"] += engine.running
        if engine.running:  # never step over a forward: stop rather than race it
            raise LendingError(f"the lent engine still runs {engine.running} rows after 30 s")
        before = engine.stats.generated_tokens
        yield
        during = engine.stats.generated_tokens - before
        self.counts["tokens_during_steps"] += during
        if during or engine.running:
            raise LendingError(
                f"the lent engine generated {during} tokens ({engine.running} running) while "
                "the trainer stepped"
            )

    def counters(self) -> dict[str, Any]:
        engine = self.engine
        return {
            **self.counts,
            "state": self.state.value,
            "completions": int(self.app[_app_key("_STATE")].get("completions", 0)),
            "generated_tokens": int(engine.stats.generated_tokens),
            "running": int(engine.running),
            "version": int(engine.version),
            "aborted_with_tokens": self._take_resumed(),
        }

    def _take_resumed(self) -> list[list[Any]]:
        taken, self.resumed = self.resumed, []
        return [[rid, version] for rid, version in taken]

    def close(self) -> None:
        """Withdraw (tombstone) and stop the replica; the engine closes with its app."""
        if self.state is LendState.CLOSED:
            return
        try:
            self.withdraw()
        finally:
            self.state = LendState.CLOSED
            if self._runner is not None:
                self._run(self._runner.cleanup())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    # --- internals ----------------------------------------------------------------------

    @property
    def engine(self) -> Any:
        return self.app[_app_key("_ENGINE")]

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=120)  # type: ignore[arg-type]

    async def _start(self, version: int) -> tuple[web.Application, str]:
        from workers.llm.engines.hf.engine import HFEngineConfig
        from workers.llm.engines.hf.server import create_app

        engine_config = HFEngineConfig(threads=self.threads, max_batch=self.config.max_batch)
        app = await create_app(
            self.model_dir,
            replica_id=LENT_REPLICA_PREFIX,
            version=version,
            config=engine_config,
            model=self.model,
        )
        app.middlewares.append(self._refuse_when_withdrawn)
        await app[_app_key("_ENGINE")].pause()  # nothing runs before the first `lend`
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        # every interface: announced at the node's address, which routers elsewhere reach
        host = routable_ip() if self.config.host == "0.0.0.0" else self.config.host
        address = self.config.advertise or f"http://{host}:{port}"
        check_reachable(address, "trainer.lend's address")
        return app, address

    @web.middleware
    async def _refuse_when_withdrawn(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # 503 sends a client that resumes here to another replica, and fails its health probe.
        if self._withdrawn and request.path in ("/v1/completions", "/health"):
            raise web.HTTPServiceUnavailable(reason="the trainer took its replica back")
        response = await handler(request)
        if request.path == "/v1/completions" and response.status == 200:
            self._note(response)
        return response

    def _note(self, response: web.StreamResponse) -> None:
        """Count a piece that finished here; note one a withdrawal aborted after it sampled
        tokens: its client resumes it on another replica (`resumed`: its request id and the
        version of these tokens)."""
        body = json.loads(response.text or "{}") if isinstance(response, web.Response) else {}
        choice = (body.get("choices") or [{}])[0]
        if choice.get("finish_reason") != "abort":
            self.counts["finished"] += 1
        elif choice.get("token_ids"):
            self.resumed.append((str(body.get("id")), int(body.get("policy_version", -1))))

    def _send(self, key: str, value: bytes | None, headers: list[Any]) -> None:
        topic = self.topics.name("replicas")
        try:
            self.producer.send(topic, key=key, value=value, headers=headers).get(
                timeout=ack_wait_s(self.kafka)
            )
        except KafkaError as exc:
            raise LendingError(f"lent replica {key} not acknowledged on {topic}: {exc}") from exc


def _app_key(name: str) -> Any:
    """The replica app's key (its engine, its state): the app is built by `hf.create_app`."""
    from workers.llm.engines.hf import server as hf

    return getattr(hf, name)
