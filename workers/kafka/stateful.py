"""A consumer-group stage with a changelogged table, on plain aiokafka: `StageLoop`,
`ChangelogTable`.

The reward and replay stages are both "consume a partitioned topic, fold records into keyed
state, produce outputs": per partition, state that must survive a crash and move with the
partition when the group rebalances. This module is that machinery, and only that:

- `ChangelogTable` (`workers.kafka.changelog`): the keyed state, backed by a compacted
  changelog topic.
- `StageLoop`: the group consumer. It fetches a batch (up to `batch_size` records, waiting at
  most `batch_within_s` for it to fill once the first record is there) and hands it to the
  stage's `process`. Only once everything the batch caused is acknowledged does it record
  the batch's offsets to commit (at least every `commit_interval_s`, on every revocation and
  on shutdown). `process` either returns when that is so, or returns early with an
  awaitable that settles it (the broker's acknowledgements): the loop then fetches and
  processes the next batch while the previous one settles, so the stage's CPU work overlaps
  its round trips to the broker. Batches settle in order; at most one is unsettled while
  the next is processed. One lock is held around each batch and taken by the rebalance
  listener, so a rebalance waits for the batch in flight, lets every batch settle, commits,
  and then drops the revoked partitions' state; newly assigned partitions are restored
  before the first fetch from them. With `sweep_interval_s` set, `process([])` runs that often when
  nothing arrives (the replay stage expires groups there, the reward stage sweeps its table).
- Commit metadata (optional, `commit_metadata`): a stage can attach a string to every offset
  commit, computed when no batch is unsettled, and read what was committed with each
  partition when it is assigned (`committed`). The reward stage records there how far the
  output topic reached, so that after a crash it knows where to look for outputs of the
  batches that were not committed.

Why not faust: faust-streaming (0.15) abandons a record whose delivery to the stream is
interrupted by a rebalance while still moving its read offset past it, and never fetches it
again; the committed offset then stays below it for good (re-seeking after a stall only
narrowed the window: a replay group could still time out partial while its samples sat
uncommitted). Here the positions are the consumer's own: a record is either
processed and then committed, or fetched again from the committed offset after a
rebalance or restart. faust's per-event machinery (stream buffers, acks, its commit
bookkeeping) was also most of the reward stage's cost per turn.

A failure in `process` (any Kafka error: the stages propagate them) ends the process at once
with exit status 70 and commits nothing, so the batch is redelivered to whoever owns its
partitions next; the stages de-duplicate. A broker's loss is not such a failure: the producers
retry through the election (`workers.kafka.clients`), commits retry while the coordinator
moves, and the offsets and committed-offset lookups are asked again (`workers.kafka.retry`);
a batch then settles late, and its offsets are committed only once it has. SIGTERM/SIGINT
finish the batch in flight, commit and leave the group.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from workers.kafka.changelog import ChangelogTable
from workers.kafka.clients import make_aio_admin, make_aio_consumer
from workers.kafka.config import KafkaConfig
from workers.kafka.retry import retrying

__all__ = ["EXIT_KAFKA_FAILURE", "StageLoop"]

log = logging.getLogger("rollout.kafka.stage")

EXIT_KAFKA_FAILURE = 70


# `process` returns None once the batch is settled, or an awaitable that settles it.
Process = Callable[[list[ConsumerRecord]], Awaitable[Awaitable[None] | None]]
OnAssigned = Callable[[frozenset[int]], Awaitable[None] | None]
CommitMetadata = Callable[[], Awaitable[str]]


class StageLoop:
    """Fetch → `process` → commit, with the tables following the group's assignment."""

    def __init__(
        self,
        kafka: KafkaConfig,
        *,
        stage: str,
        group_id: str,
        topic: str,
        tables: list[ChangelogTable],
        process: Process,
        on_assigned: OnAssigned | None = None,
        batch_size: int,
        batch_within_s: float,
        commit_interval_s: float,
        session_timeout_s: float,
        sweep_interval_s: float | None = None,
        commit_metadata: CommitMetadata | None = None,
    ) -> None:
        self.stage, self.topic, self.tables = stage, topic, tables
        self.kafka, self.group_id = kafka, group_id
        self.bootstrap = kafka.bootstrap
        self.process, self.on_assigned = process, on_assigned
        self.commit_metadata = commit_metadata
        self.batch_size, self.batch_within_s = batch_size, batch_within_s
        self.commit_interval_s, self.sweep_interval_s = commit_interval_s, sweep_interval_s
        self.session_timeout_s = session_timeout_s  # the group's other timeouts follow from it
        self.consumer: AIOKafkaConsumer | None = None  # made in `run` (aiokafka wants a loop)
        self.assigned: frozenset[int] = frozenset()
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._uncommitted: dict[TopicPartition, int] = {}
        self._unsettled: list[tuple[asyncio.Future[None], dict[int, int]]] = []
        # With `commit_metadata`: what the group had committed for each assigned partition
        # when it was assigned (offset -1 and "" if nothing), then what this loop committed.
        self.committed: dict[int, OffsetAndMetadata] = {}
        self._returned: set[int] = set()  # partitions with records handed to `process`
        self._last_metadata: str | None = None
        self._last_commit = time.monotonic()

    def stop(self) -> None:
        """Finish the batch in flight, commit and leave the group (SIGTERM, SIGINT)."""
        self._stopping.set()

    async def serve(
        self, start: Callable[[], Awaitable[None]], close: Callable[[], Awaitable[None]]
    ) -> int:
        """`start` the stage's clients, `run` until stopped, `close` them; the exit status
        (70 when the broker cannot be reached: a supervisor starts the stage again)."""
        try:
            await start()
            await self.run()
        except KafkaError as exc:
            log.critical("%s stage: Kafka at %s: %s", self.stage, self.bootstrap, exc)
            return EXIT_KAFKA_FAILURE
        except Exception:
            log.critical("%s stage failed", self.stage, exc_info=True)
            return 1
        finally:
            await close()
        return 0

    async def run(self) -> None:
        """Until `stop()`; a failed batch exits the process (status 70) without committing."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        _tune_gc()
        self.consumer = consumer = make_aio_consumer(
            self.kafka,
            group_id=self.group_id,
            client_id=f"{self.kafka.client_id}-{self.group_id}",
            session_timeout_s=self.session_timeout_s,
        )
        consumer.subscribe([self.topic], listener=_Listener(self))
        await consumer.start()
        last_batch = time.monotonic()
        try:
            while not self._stopping.is_set():
                records = await self._fetch()
                async with self._lock:
                    records = [r for r in records if r.partition in self.assigned]
                    idle = (
                        self.sweep_interval_s is not None
                        and time.monotonic() - last_batch >= self.sweep_interval_s
                    )
                    if records or (idle and self.assigned):
                        await self._process(records)
                        last_batch = time.monotonic()
                    if time.monotonic() - self._last_commit >= self.commit_interval_s:
                        await self._commit()
            async with self._lock:
                await self._settle()
                await self._commit()
        finally:
            await consumer.stop()

    async def _fetch(self) -> list[ConsumerRecord]:
        """One batch: wait up to a second for a first record, then fill for `batch_within_s`."""
        assert self.consumer is not None
        wait = min(1.0, self.sweep_interval_s) if self.sweep_interval_s is not None else 1.0
        got = await self.consumer.getmany(timeout_ms=int(wait * 1000), max_records=self.batch_size)
        records = [r for rs in got.values() for r in rs]
        deadline = time.monotonic() + self.batch_within_s
        while records and len(records) < self.batch_size and not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            more = await self.consumer.getmany(
                timeout_ms=int(left * 1000), max_records=self.batch_size - len(records)
            )
            records += [r for rs in more.values() for r in rs]
        return records

    async def _process(self, records: list[ConsumerRecord]) -> None:
        try:
            settle = await self.process(records)
        except Exception:
            # Nothing of this batch is committed: whoever owns its partitions next gets it again.
            self._fail("batch failed; exiting without commit")
        last: dict[int, int] = {}
        for record in records:
            last[record.partition] = record.offset + 1
        self._returned |= set(last)
        if settle is None and not self._unsettled:
            self._record(last)
            return
        future = asyncio.ensure_future(settle if settle is not None else asyncio.sleep(0))
        future.add_done_callback(self._settled)
        self._unsettled.append((future, last))
        await self._settle(keep=1)

    def _settled(self, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and (exc := future.exception()) is not None:
            self._fail("batch failed to settle; exiting without commit", exc)

    async def _settle(self, keep: int = 0) -> None:
        """Wait for the oldest unsettled batches until `keep` are left; record their offsets."""
        while len(self._unsettled) > keep or (self._unsettled and self._unsettled[0][0].done()):
            future, last = self._unsettled[0]
            await future
            self._unsettled.pop(0)
            self._record(last)

    def _record(self, last: dict[int, int]) -> None:
        for partition, offset in last.items():
            self._uncommitted[TopicPartition(self.topic, partition)] = offset

    def _fail(self, message: str, exc: BaseException | None = None) -> NoReturn:
        """Log `message` with the exception (`exc`, else the one being handled); exit 70."""
        log.critical("%s %s", self.stage, message, exc_info=exc or True)
        logging.shutdown()
        os._exit(EXIT_KAFKA_FAILURE)

    async def _commit(self) -> None:
        """Commit the offsets after every settled record (the lock is held)."""
        self._last_commit = time.monotonic()
        if self.commit_metadata is not None:
            await self._settle()
            try:
                offsets = await self._offsets_with_metadata()
            except KafkaError:
                self._fail("cannot read the commit metadata; exiting")
        else:
            await self._settle(keep=len(self._unsettled))  # only the ones already settled
            offsets = {
                tp: o for tp, o in self._uncommitted.items() if tp.partition in self.assigned
            }
        self._uncommitted.clear()
        if not offsets:
            return
        assert self.consumer is not None
        try:
            await self.consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on: the new owner gets these records again (and de-duplicates).
            log.warning("%s: offsets not committed (%s); they will be redelivered", self.stage, exc)
            return
        except KafkaError:
            self._fail("cannot commit offsets; exiting")
        for tp, committed in offsets.items():
            if isinstance(committed, OffsetAndMetadata):
                self.committed[tp.partition] = committed

    async def _offsets_with_metadata(self) -> dict[TopicPartition, Any]:
        """Every assigned partition's offset, with the stage's metadata (no batch unsettled).

        Partitions without new records are committed again with the fresh metadata, so that
        what each partition's commit says stays recent; a partition that never had a commit
        and handed out no record yet gets its beginning offset (where it would start anyway).
        """
        assert self.commit_metadata is not None and self.consumer is not None
        metadata = await self.commit_metadata()
        if not self._uncommitted and metadata == self._last_metadata:
            return {}
        self._last_metadata = metadata
        offsets: dict[TopicPartition, Any] = {}
        fresh: list[TopicPartition] = []
        for partition in sorted(self.assigned):
            tp = TopicPartition(self.topic, partition)
            known = self.committed.get(partition)
            if tp in self._uncommitted:
                offsets[tp] = OffsetAndMetadata(self._uncommitted[tp], metadata)
            elif known is not None and known.offset >= 0:
                offsets[tp] = OffsetAndMetadata(known.offset, metadata)
            elif partition not in self._returned:
                fresh.append(tp)
        if fresh:
            for tp, offset in (await self.consumer.beginning_offsets(fresh)).items():
                offsets[tp] = OffsetAndMetadata(offset, metadata)
        return offsets

    async def revoked(self, partitions: set[int]) -> None:
        async with self._lock:  # waits for the batch in flight
            await self._settle()
            await self._commit()
            self.assigned = frozenset()
            self._returned.clear()
        log.info("%s: partitions %s revoked", self.stage, sorted(partitions))

    async def assigned_now(self, partitions: set[int]) -> None:
        async with self._lock:
            if self.commit_metadata is not None:
                self.committed = await self._fetch_committed(partitions)
            for table in self.tables:
                table.drop(table.partitions - partitions)
                await table.restore(partitions)
            self.assigned = frozenset(partitions)
            if self.on_assigned is not None:
                result = self.on_assigned(self.assigned)
                if result is not None:
                    await result
        log.info("%s: partitions %s assigned", self.stage, sorted(partitions))

    async def _fetch_committed(self, partitions: set[int]) -> dict[int, OffsetAndMetadata]:
        """The group's committed offset and metadata of each partition (-1, "" if none)."""
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]

        async def ask() -> dict[TopicPartition, OffsetAndMetadata]:
            client_id = f"{self.kafka.client_id}-{self.group_id}-admin"
            admin = make_aio_admin(self.kafka, client_id=client_id)
            await admin.start()
            try:
                found: dict[
                    TopicPartition, OffsetAndMetadata
                ] = await admin.list_consumer_group_offsets(self.group_id, partitions=tps)
                return found
            finally:
                await admin.close()

        # The coordinator may be moving (its broker died): asked again, not fatal.
        found = await retrying(ask, f"{self.group_id}'s committed offsets")
        none = OffsetAndMetadata(-1, "")
        return {tp.partition: found.get(tp, none) for tp in tps}


def _tune_gc() -> None:
    """Fewer cyclic-GC passes over a heap that is mostly long-lived.

    A batch allocates hundreds of thousands of short-lived objects (decoded events, their
    arrays, dicts), so the default gen-0 threshold (700) ran collections that also walked
    the table and every imported module, again and again. Objects alive at start (modules,
    config) are frozen out of collection; gen 0 is collected every 100,000 allocations.
    Nothing in the stages relies on prompt collection of cycles. In `rollout bench reward`
    this cut the batch time by about a quarter (decode: 0.61-0.71 s → 0.28-0.47 s of 2000
    trajectories).
    """
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, loop: StageLoop) -> None:
        self.loop = loop

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.loop.revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        try:
            await self.loop.assigned_now({tp.partition for tp in assigned})
        except Exception:
            log.critical("%s: cannot restore its tables; exiting", self.loop.stage, exc_info=True)
            logging.shutdown()
            os._exit(EXIT_KAFKA_FAILURE)
