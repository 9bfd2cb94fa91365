"""The replay-buffer stage: a faust agent on `rl.scored` → one `TrainingGroup` per prompt.

One agent (`concurrency=1`) consumes `rl.scored` and the stage's own tick topic (same
partition count, so faust assigns partition p of both to the same worker) in batches
(`stream.take_events`); `batch.GroupProcessor` does the work of each batch and returns only
when everything it caused is acknowledged. Only then does the agent ask for the next batch,
which is when faust acknowledges the batch's events; faust commits acknowledged offsets on
its timer. So an offset is committed only after its outputs are acknowledged (at-least-once
on the input).

Timeouts without timers touching tables: a background task produces one tick per partition
to `{app_id}-ticks` every `tick_interval_s`; ticks wake the agent, and expiry happens in the
agent like everything else. Table writes go to the changelog with the stage's own idempotent
producer and an explicit partition (`table`), never through faust's `table[k] = v`, which
needs a current event.

Exactly once on `rl.replay` and `rl.stale`: a group is produced only from PENDING, after an
EMITTING marker (with its output partition's end offset) is acknowledged. After a crash the
stage reads the output partition from the recorded offset; a group found there becomes DONE,
a missing one is judged again (with the policy version of now). As in the reward stage, the
only duplicate possible is an output the broker accepted without the stage seeing the
acknowledgement *and* landing after the restart's scan; the trainer can still de-duplicate
by uid. A uid must identify one rollout of a prompt (put the epoch into it): once DONE, its
later samples are late. Dead letters are at-least-once. Any failure to talk to Kafka ends
the process at once (exit 70) without committing; restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import faust
from aiokafka import AIOKafkaProducer

from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.faust_app import StallGuard, make_faust_app
from workers.metrics import StageMetrics
from workers.replay.batch import GroupProcessor, Routes
from workers.replay.config import ReplayConfig
from workers.replay.ledger import GroupLedger
from workers.replay.policy import PolicyTracker
from workers.replay.stats import ReplayStats
from workers.replay.table import GroupTable

__all__ = ["EXIT_KAFKA_FAILURE", "ReplayStage"]

log = logging.getLogger("rollout.replay")

EXIT_KAFKA_FAILURE = 70
_TICK = b'{"tick":true}'


class ReplayStage:
    """The faust app, its table and agent, and the clients the agent produces with."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        config: ReplayConfig,
        *,
        source_partitions: int,
        metrics: StageMetrics | None = None,
    ) -> None:
        self.kafka = kafka
        self.config = config
        self.scored_topic = topics.name("scored")
        self.replay_topic = topics.name("replay")
        self.stale_topic = topics.name("stale")
        self.policy_topic = topics.name("policy")
        self.dlq_topic = topics.name("dlq")
        self.tick_topic = config.tick_topic
        self.partitions = source_partitions
        self.stats = ReplayStats(config.stats_path)
        self.metrics = metrics or StageMetrics("replay")
        timeout = config.session_timeout_s
        self.app = make_faust_app(
            kafka,
            config.app_id,
            data_dir=config.data_dir,
            replication_factor=topics.replication_factor,
            commit_interval_s=config.commit_interval_s,
            broker_session_timeout=timeout,
            broker_rebalance_timeout=timeout,
            broker_heartbeat_interval=max(1.0, timeout / 10),
            stream_buffer_maxsize=max(4096, 2 * config.batch_size),
        )
        source = self.app.topic(
            self.scored_topic, self.tick_topic, key_type=bytes, value_type=bytes
        )
        self.table = GroupTable(
            self.app.Table(
                "groups",
                default=None,
                partitions=source_partitions,
                key_type=bytes,
                value_type=bytes,
            )
        )
        self.app.agent(source, name=f"{config.app_id}-agent", concurrency=1)(self._agent)
        stall_s = max(30.0, 3 * config.session_timeout_s)
        self._guard = StallGuard(self.app, {self.scored_topic, self.tick_topic}, stall_s)
        self._guard_task: asyncio.Task[None] | None = None
        self.producer: AIOKafkaProducer | None = None
        self.ledger: GroupLedger | None = None
        self.policy: PolicyTracker | None = None
        self.processor: GroupProcessor | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.metrics.watch(
            in_flight=lambda: self.processor.open_groups if self.processor else 0,
            policy_version=lambda: self.policy.version if self.policy else 0,
        )
        self._assigned: frozenset[int] | None = None
        self._in_batch = False
        self._last_log = time.monotonic()

    # --- lifecycle -------------------------------------------------------------------

    async def start_clients(self) -> None:
        """Producer, output ledger, policy tracker and ticker (once, in the agent)."""
        client_id = f"{self.kafka.client_id}-{self.config.app_id}"
        self.producer = AIOKafkaProducer(
            **self.kafka.aiokafka_kwargs(),
            client_id=f"{client_id}-out",
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            max_batch_size=1024 * 1024,
            max_request_size=self.kafka.max_request_size,
        )
        await self.producer.start()
        self._guard_task = asyncio.create_task(self._guard.run())
        self.table.producer = self.producer
        self.ledger = GroupLedger(
            self.kafka, [self.replay_topic, self.stale_topic], client_id=f"{client_id}-ledger"
        )
        await self.ledger.start(self.producer)
        self.policy = PolicyTracker(self.kafka, self.policy_topic, client_id=f"{client_id}-policy")
        await self.policy.start(self.producer)
        routes = Routes(
            tick=self.tick_topic,
            replay=self.replay_topic,
            stale=self.stale_topic,
            dlq=self.dlq_topic,
        )
        self.processor = GroupProcessor(
            self.config, self.table, self.stats, routes,
            producer=self.producer, ledger=self.ledger, policy=self.policy, metrics=self.metrics,
        )  # fmt: skip
        self._ticker = asyncio.create_task(self._tick_forever(), name="replay-ticker")
        self.app.on_before_shutdown.connect(self._on_shutdown)
        log.info("replay stage ready: n=%d, policy version %d", self.config.n, self.policy.version)

    async def _on_shutdown(self, app: Any, **_: Any) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for client in (self.policy, self.ledger, self.producer):
            if client is not None:
                await client.stop()

    async def _tick_forever(self) -> None:
        """Wake the agent on every partition, so groups expire even when no sample arrives."""
        assert self.producer is not None
        while True:
            await asyncio.sleep(self.config.tick_interval_s)
            try:
                for partition in range(self.partitions):
                    await self.producer.send(self.tick_topic, _TICK, partition=partition)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("could not produce ticks to %s", self.tick_topic, exc_info=True)

    async def _agent(self, stream: faust.StreamT[bytes]) -> None:
        try:
            await self.start_clients()
        except Exception:
            # faust would restart the agent forever; a stage that cannot start should stop.
            log.critical("replay stage cannot start", exc_info=True)
            os._exit(1)
        try:
            async for events in stream.take_events(
                self.config.batch_size, within=self.config.batch_within_s
            ):
                self._in_batch = self._guard.busy = True
                try:
                    await self.process(list(events))
                except Exception:
                    # faust would acknowledge this batch's events on the way out and
                    # commit them: exit before it can, so they are redelivered.
                    log.critical("replay batch failed; exiting without commit", exc_info=True)
                    os._exit(EXIT_KAFKA_FAILURE)
                self._in_batch = self._guard.busy = False
        except asyncio.CancelledError:
            if self._in_batch:
                log.critical("replay agent cancelled mid-batch; exiting without commit")
                os._exit(EXIT_KAFKA_FAILURE)
            raise

    # --- one batch -------------------------------------------------------------------

    async def process(self, events: list[Any]) -> None:
        """One batch (see `batch`); reindex the open groups first if the assignment changed."""
        started = time.monotonic()
        assert self.processor is not None
        assignment = self.app.consumer.assignment()
        assigned = frozenset(tp.partition for tp in assignment if tp.topic == self.scored_topic)
        if assigned != self._assigned:
            self._assigned = assigned
            self.processor.reindex(assigned)
        await self.processor.process(events)
        self._after_batch(started)

    def _after_batch(self, started: float) -> None:
        self.stats.last_batch_s = time.monotonic() - started
        self.stats.write()
        now = time.monotonic()
        if now - self._last_log > 30:
            self._last_log = now
            log.info("replay stats: %s", self.stats.snapshot())
