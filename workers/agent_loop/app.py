"""The agent-loop worker: `rl.prompts` → agent loops → `rl.turns`, many prompts at once.

Why aiokafka here (and kafka-python elsewhere): the worker is one asyncio program running
hundreds of generations; aiokafka's consumer and producer live on the same event loop, its
rebalance listener can `await` the cancellation of the revoked partitions' work before the
partitions move, and heartbeats run in the background while generations are long. Driving
kafka-python from a thread would add a hand-off per record and callbacks on another thread
for the same throughput (the stage's cost is generation, not Kafka).

Delivery (at-least-once, de-duplicated downstream):
- A prompt's offset is finished only after every turn of its `n` samples (or its dead
  letter) is acknowledged by the broker; per partition only the contiguous prefix of
  finished offsets is committed (`OffsetTracker`).
- Backpressure: at most `max_samples_in_flight` samples run, each prompt counted by its own
  `n` (a prompt that does not fit is fetched again later; one that alone exceeds the bound
  runs when nothing else does). A sample's slot is free once its agent loop returned: the
  acknowledgement of its turns (`turns_linger_ms` of batching, then the broker's round trip)
  holds the prompt's offset, not a generation slot. When full, or when the staleness gate is
  closed, the worker takes no record; what aiokafka fetched ahead waits in its buffer (one
  fetch per partition at most: it fetches a partition again only once that is taken), and
  after `PAUSE_AFTER_S` of it the partitions are paused, which keeps the worker polling.
- Rebalance: the revoked partitions' unfinished prompts are cancelled, what is finished is
  committed, the rest is redelivered to the new owner, whose regenerated events carry a new
  `attempt_id`.
- SIGTERM: stop fetching, let in-flight prompts finish within the grace period, cancel the
  rest, commit, close.
- A prompt that cannot be processed (not a PromptEvent, unknown agent, prompt too long,
  tool config error, a replica's 4xx, an image missing from the media store, undecodable, or
  sent to a text-only policy: `images`) goes to the dead-letter topic with its reason. A tool
  parser that cannot be found (`tool_parser`) is no prompt's fault: the worker fails at start.
- A prompt that fails for reasons not its own (replicas unreachable past every retry, the
  broker refusing its turns) is never dead-lettered: it stays unfinished, the worker stops
  (`rollout worker agent-loop` exits 75) and the prompt is redelivered after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError

from schemas.codec import decode_as, encode, headers_for
from schemas.errors import DecodeError, RolloutError
from schemas.events import PromptEvent, TurnEvent
from schemas.stale import staleness
from workers.agent_loop.admission import AdmissionGate
from workers.agent_loop.base import AgentContext, TurnRecord
from workers.agent_loop.chat_format import ChatFormat
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.agent_loop.exceptions import AgentLoopError
from workers.agent_loop.follow import (
    follow_dead_prompts,
    follow_group_progress,
    follow_policy,
    follow_replicas,
    follow_upstream_drops,
)
from workers.agent_loop.images import LoopImages, PromptImages, is_vision_model, messages_of
from workers.agent_loop.loops import get_agent_loop
from workers.agent_loop.offsets import OffsetTracker
from workers.agent_loop.turns import TurnEmitter
from workers.kafka.admin import missing_topics
from workers.kafka.clients import make_aio_consumer, make_aio_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.dlq import AioDeadLetters
from workers.kafka.exceptions import KafkaUnavailableError
from workers.llm.exceptions import BadRequestError
from workers.metrics import StageMetrics

__all__ = ["AgentLoopWorker"]

log = logging.getLogger("rollout.agent_loop.worker")

STAGE = "agent-loop"
# How long the worker may be full (no sample slot, or the staleness gate closed) before it
# pauses its partitions: well under aiokafka's max poll interval (300 s), over a prompt's
# usual generation time.
PAUSE_AFTER_S = 10.0


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: AgentLoopWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.worker._revoke(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))


class AgentLoopWorker:
    """Consume prompts, run their samples' agent loops, produce every turn."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        config: AgentLoopWorkerConfig,
        *,
        llm: Any = None,
        tokenizer: Any = None,
        tools: dict[str, Any] | None = None,
        metrics: StageMetrics | None = None,
    ) -> None:
        self.kafka = kafka
        self.topics = topics
        self.config = config
        self.llm = llm
        self.tokenizer = tokenizer
        self.tools = tools
        self.chat: ChatFormat | None = None
        self.images: PromptImages | None = None
        self.tracker = OffsetTracker()
        self.gate = AdmissionGate(
            config.admission.max_staleness, config.admission.train_batch_size, synced=False
        )
        self.counters: dict[str, int] = defaultdict(int)
        self._tasks: dict[TopicPartition, dict[int, asyncio.Task[None]]] = defaultdict(dict)
        self._samples_in_flight = 0
        self._policy_version = 0  # latest version the trainer published
        self._generated_version = 0  # newest version a replica generated one of our turns with
        self._next_version_probe = 0.0
        self._stopping = asyncio.Event()
        self._room_freed = asyncio.Event()  # set when a prompt's samples release their slots
        self._background: list[asyncio.Task[None]] = []
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.letters: AioDeadLetters | None = None
        self.metrics = metrics or StageMetrics("agent-loop")
        self.metrics.watch(
            in_flight=lambda: self._samples_in_flight,
            policy_version=lambda: max(self._policy_version, self._generated_version),
        )

    def stop(self) -> None:
        """Ask the worker to shut down gracefully (what SIGTERM does)."""
        self._stopping.set()

    # --- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._setup()
            await self._consume()
        finally:  # after a failed setup too: what it started is closed, not left to the GC
            await self._shutdown()

    async def _setup(self) -> None:
        cfg = self.config
        if missing := missing_topics(
            self.kafka, [self.topics.name(r) for r in ("prompts", "turns")]
        ):
            raise AgentLoopError(f"no topic {', '.join(missing)} (run `rollout topics create`)")
        tail = f"{self.kafka.client_id}-{STAGE}-tail"
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        # A tool parser that cannot be found stops the worker here, in one line, rather than
        # dead-lettering every prompt that would use it.
        self.chat = ChatFormat.load(
            self.tokenizer, tool_parser=cfg.tool_parser, template_kwargs=cfg.chat_template_kwargs
        )
        vision = is_vision_model(cfg.model, self.tokenizer)
        processor = None
        if vision:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(cfg.model)
        self.images = PromptImages(cfg.media, vision=vision, model=cfg.model, processor=processor)
        if self.tools is None:
            self.tools = {}
            if cfg.loops.tool_config:
                from workers.agent_loop.tools.config import load_tools

                self.tools = load_tools(cfg.loops.tool_config)
        self.producer = make_aio_producer(
            self.kafka, client_id=f"{self.kafka.client_id}-{STAGE}", linger_ms=cfg.turns_linger_ms
        )
        self.letters = AioDeadLetters(
            self.producer, self.topics.name("dlq"), stage=STAGE, metrics=self.metrics
        )
        await self.producer.start()
        if self.llm is None:
            from workers.llm.client import LLMClient

            self.llm = LLMClient(cfg.llm, cfg.replicas)
            await self.llm.start()
            if not cfg.replicas:
                self._follow(follow_replicas(self.kafka, self.topics, self.llm, client_id=tail))
        if cfg.admission.max_staleness is not None:
            self._follow(
                follow_policy(self.kafka, self.topics, self.gate, self._saw_version, client_id=tail)
            )
            self._follow(
                follow_upstream_drops(self.kafka, self.topics, self.gate, client_id=f"{tail}-stale")
            )
            self._follow(
                follow_dead_prompts(self.kafka, self.topics, self.gate, client_id=f"{tail}-dlq")
            )
        self.consumer = make_aio_consumer(
            self.kafka, group_id=cfg.group_id, client_id=f"{self.kafka.client_id}-{STAGE}"
        )
        self.consumer.subscribe([self.topics.name("prompts")], listener=_Rebalance(self))
        await self.consumer.start()
        if cfg.admission.max_staleness is not None:
            self._follow(
                follow_group_progress(
                    self.kafka,
                    self.topics,
                    self.gate,
                    self.consumer,
                    self.tracker,
                    group_id=cfg.group_id,
                    client_id=f"{tail}-gate",
                )
            )

    def _follow(self, follower: Coroutine[Any, Any, None]) -> None:
        """Run a follower of another stage's topic (`follow`) until shutdown."""
        self._background.append(asyncio.create_task(follower))

    async def _shutdown(self) -> None:
        pending = [t for tasks in self._tasks.values() for t in tasks.values()]
        if pending:
            log.info(
                "shutting down: waiting up to %.0fs for %d prompts",
                self.config.grace_period_s,
                len(pending),
            )
            _done, late = await asyncio.wait(pending, timeout=self.config.grace_period_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        try:
            await self._commit()
        finally:
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            if self.consumer is not None:
                await self.consumer.stop()
            if self.producer is not None:
                await self.producer.stop()
            if self.llm is not None and hasattr(self.llm, "close"):
                await self.llm.close()

    # --- the loop ---------------------------------------------------------------------

    async def _consume(self) -> None:
        consumer = self.consumer
        assert consumer is not None
        loop = asyncio.get_running_loop()
        next_commit = loop.time() + self.config.commit_interval_s
        full_since: float | None = None  # since when no prompt could be taken
        while not self._stopping.is_set():
            # Prompts to take now: bounded by free sample slots and by the staleness gate.
            # Records past `max_records` stay in the consumer's buffer, not in ours.
            room = min(
                (self.config.max_samples_in_flight - self._samples_in_flight) // self.config.n,
                self.gate.room(),
            )
            if room > 0 and not await self._replicas_current():
                room = 0
            if room <= 0:
                full_since = loop.time() if full_since is None else full_since
                # Wait for a slot (a prompt finishing), not 200 ms for a fetch: that left the
                # freed slots and the replicas idle meanwhile.
                await self._until_room_freed(0.2)
                batch = {}
                if loop.time() - full_since >= PAUSE_AFTER_S:
                    # Full for long (a closed staleness gate, long agent loops): pause, and
                    # poll the paused partitions (nothing, at once) so that the group still
                    # sees this member polling within its max poll interval. Not at once:
                    # aiokafka drops what it fetched for a partition that is paused when
                    # polled, so pausing on every full moment refetched and decoded the
                    # prompts ahead once per prompt finished.
                    consumer.pause(*consumer.assignment())
                    batch = await consumer.getmany(timeout_ms=0, max_records=1)
            else:
                full_since = None
                if consumer.paused():
                    consumer.resume(*consumer.paused())
                batch = await consumer.getmany(timeout_ms=200, max_records=room)
            for tp, records in batch.items():
                for record in records:
                    prompt = self._decode(record)
                    own = prompt.n if isinstance(prompt, PromptEvent) else None
                    n = own or self.config.n
                    free = self.config.max_samples_in_flight - self._samples_in_flight
                    if n > free and self._samples_in_flight > 0:
                        # This prompt's own n does not fit yet: fetch it again later.
                        consumer.seek(tp, record.offset)
                        break
                    self._start(tp, record, n, prompt)
            if loop.time() >= next_commit:
                await self._commit()
                next_commit = loop.time() + self.config.commit_interval_s

    async def _until_room_freed(self, timeout_s: float) -> None:
        """Return when a prompt finished (its samples' slots are free) or after `timeout_s`
        (the staleness gate opens without a prompt finishing; stop and commits are due)."""
        self._room_freed.clear()
        try:
            await asyncio.wait_for(self._room_freed.wait(), timeout_s)
        except TimeoutError:
            pass

    async def _replicas_current(self) -> bool:
        """With bounded staleness, admit only while every routable replica serves the latest
        published version (a replica's `staleness` against it is 0): a sample generated by a
        lagging replica could be trained past the bound. Replica versions come from their
        /health, probed at most every 0.5 s here."""
        if self.config.admission.max_staleness is None or self._policy_version == 0:
            return True

        def current() -> bool:
            replicas = self.llm.balancer.routable()
            return all(staleness(self._policy_version, rep.version) == 0 for rep in replicas)

        if current():
            return True
        now = asyncio.get_running_loop().time()
        if now >= self._next_version_probe:
            self._next_version_probe = now + 0.5
            await self.llm.check_health()
        return current()

    def _decode(self, record: Any) -> PromptEvent | DecodeError:
        """The record's prompt, decoded once: its own `n` sizes its admission, and `_process`
        runs it (or dead-letters the error)."""
        try:
            prompt = decode_as(record.value, PromptEvent)
            if record.key is not None and record.key != prompt.uid.encode():
                raise DecodeError(
                    f"record key {record.key!r} is not the prompt's uid {prompt.uid!r}",
                    cause="key_mismatch",
                )
        except DecodeError as exc:
            return exc
        return prompt

    def _start(
        self, tp: TopicPartition, record: Any, samples: int, prompt: PromptEvent | DecodeError
    ) -> None:
        self._samples_in_flight += samples  # reserved until the prompt is done
        peak = self.counters["samples_in_flight_peak"]
        self.counters["samples_in_flight_peak"] = max(peak, self._samples_in_flight)
        self.tracker.start(tp, record.offset)
        self.gate.admit()
        self.counters["prompts_started"] += 1
        self.metrics.consumed(record.topic)
        task = asyncio.create_task(self._process(tp, record, samples, prompt))
        self._tasks[tp][record.offset] = task

    async def _process(
        self, tp: TopicPartition, record: Any, samples: int, prompt: PromptEvent | DecodeError
    ) -> None:
        held = samples  # slots this prompt still holds

        def release(count: int) -> None:
            """Give back `count` of the prompt's sample slots (a sample's generation ended)."""
            nonlocal held
            count = min(count, held)
            held -= count
            self._samples_in_flight -= count
            self._room_freed.set()

        try:
            try:
                if isinstance(prompt, DecodeError):
                    raise prompt
                await self._run_prompt(prompt, release)
            except (DecodeError, AgentLoopError, BadRequestError) as exc:
                await self._dead_letter(record, exc)  # the gate counts it from rl.dlq
            except RolloutError:
                raise
            except KafkaError as exc:
                # The broker failed us (a restart, a leader election), not the prompt: never
                # dead-letter it; leave it unfinished so it is redelivered after a restart.
                raise KafkaUnavailableError(f"producing turns: {exc!r}") from exc
            except Exception as exc:  # a bug in a loop or a tool: this prompt, not the worker
                log.exception("prompt at %s[%d]@%d raised", tp.topic, tp.partition, record.offset)
                await self._dead_letter(
                    record, AgentLoopError(f"{type(exc).__name__}: {exc}", cause="agent_loop")
                )
            self.tracker.finish(tp, record.offset)
            self.counters["prompts_done"] += 1
        except asyncio.CancelledError:
            self.counters["prompts_cancelled"] += 1
            raise
        except RolloutError as exc:
            # Replicas unreachable past every retry: leave the offset unfinished so the prompt
            # is redelivered after a restart, and stop rather than skip it. The rest in flight
            # then fail alike: the first says why, the others are counted.
            level = logging.DEBUG if self.counters["prompts_failed"] else logging.ERROR
            log.log(
                level, "prompt at %s[%d]@%d failed: %s", tp.topic, tp.partition, record.offset, exc
            )
            self.counters["prompts_failed"] += 1
            self.stop()
        finally:
            release(held)
            self._tasks[tp].pop(record.offset, None)

    async def _run_prompt(self, prompt: PromptEvent, release: Callable[[int], None]) -> None:
        cfg = self.config
        loop_cls = get_agent_loop(
            prompt.agent_name or cfg.loops.default_agent, cfg.loops.user_loops
        )
        n = prompt.n or cfg.n
        assert self.images is not None
        images: LoopImages | None = None
        if any(not isinstance(m.content, str) for m in prompt.prompt):
            # File reads and decoding off the event loop; a bad image dead-letters the prompt.
            prompt, images = await asyncio.to_thread(self.images.resolve, prompt)
        # else text only: `resolve` would return it as is; no thread hop per prompt
        if images is not None and not getattr(loop_cls, "takes_images", False):
            raise AgentLoopError(
                f"agent loop {loop_cls.__name__} does not take images", cause="image_unsupported"
            )
        digest = prompt.content_digest()  # once per prompt: its samples' turn 0s all carry it
        results = await asyncio.gather(
            *(self._run_sample(loop_cls, prompt, i, n, images, digest, release) for i in range(n)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _run_sample(
        self,
        loop_cls: type,
        prompt: PromptEvent,
        index: int,
        n: int,
        images: LoopImages | None,
        digest: str,
        release: Callable[[int], None],
    ) -> None:
        cfg = self.config
        attempt = uuid.uuid4().hex[:16]
        emitter = TurnEmitter(self._send_turn, prompt, index, attempt, n, prompt_digest=digest)
        started = last = time.monotonic()

        async def on_turn(record: TurnRecord) -> None:
            nonlocal last
            now = time.monotonic()
            self.metrics.observe_turn(now - last)  # one turn: a generation or a tool call
            last = now
            await emitter.on_turn(record)

        context = AgentContext(
            llm=self.llm,
            tokenizer=self.tokenizer,
            on_turn=on_turn,
            tools=self.tools or {},
            max_prompt_length=cfg.loops.max_prompt_length,
            max_response_length=cfg.loops.max_response_length,
            options=dict(cfg.loops.options),
            chat=self.chat,
        )
        output = await loop_cls(context).run(
            cfg.sampling,
            messages=messages_of(prompt, self.images.token if self.images else "<image>"),
            request_id=emitter.trajectory_id,
            uid=prompt.uid,
            sample_index=index,
            extra_info=prompt.extra_info,
            **({"images": images} if images else {}),
        )
        # Its generation is over: the slot goes to the next prompt while the broker
        # acknowledges its turns (the prompt's offset still waits for them).
        release(1)
        await emitter.finish(output)
        self.counters["trajectories"] += 1
        self.metrics.observe_trajectory(time.monotonic() - started)

    async def _send_turn(self, event: TurnEvent) -> asyncio.Future[Any]:
        assert self.producer is not None
        self.counters["turns"] += 1
        self.metrics.produced(self.topics.name("turns"))
        self._generated_version = max(self._generated_version, event.max_global_steps)
        future: asyncio.Future[Any] = await self.producer.send(
            self.topics.name("turns"),
            key=event.trajectory_id.encode(),
            value=encode(event),
            headers=headers_for(event),
        )
        return future

    async def _dead_letter(self, record: Any, exc: BaseException) -> None:
        assert self.letters is not None
        self.counters["dead_letters"] += 1
        await (await self.letters.send_record(record, exc))

    # --- offsets and rebalancing -------------------------------------------------------

    async def _commit(self, only: list[TopicPartition] | None = None) -> None:
        points = self.tracker.commit_points()
        if only is not None:
            points = {tp: point for tp, point in points.items() if tp in only}
        if not points or self.consumer is None:
            return
        try:
            # The metadata is how far this worker has started on the partition: the other
            # workers' admission gates count prompts in flight here before they finish.
            await self.consumer.commit(
                {tp: (pos, str(started)) for tp, (pos, started) in points.items()}
            )
        except CommitFailedError as exc:
            # The group rebalanced under us: these prompts are redelivered to their new owner
            # (at-least-once; downstream de-duplicates), which is no reason to crash.
            log.warning("commit failed after a rebalance (%s); the new owner redoes them", exc)
            return
        self.tracker.mark_points(points)

    async def _revoke(self, revoked: list[TopicPartition]) -> None:
        tasks = [t for tp in revoked for t in self._tasks.get(tp, {}).values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._commit(only=revoked)
        finally:
            for tp in revoked:
                self.tracker.drop(tp)
                self._tasks.pop(tp, None)
        if tasks:
            log.info(
                "revoked %d partitions; %d unfinished prompts go to the new owner",
                len(revoked),
                len(tasks),
            )

    def _saw_version(self, version: int) -> None:
        self._policy_version = max(self._policy_version, version)
