"""`StageLoop`'s bookkeeping, without a broker: which offsets it may commit, and when.

The loop's consumer (fetch, commit, beginning offsets) is a Kafka client and is left to the
integration tests (tests/integration/test_reward_worker.py, test_replay_worker.py: SIGKILL
mid-stream, partitions moving between two workers, uncommitted batches not emitted twice).
What is tested here is what the loop decides on its own: a batch's offsets (one past each
partition's last record) become committable only once everything the batch caused is
acknowledged, batches settle in order with at most one unsettled behind the one being
processed, a failed batch or acknowledgement exits with status 70 and records nothing,
offsets of partitions no longer assigned are never committed, tables follow the assignment,
and the commit metadata is attached to every assigned partition.

The offset bookkeeping has no public seam, so `feed`, `settle` and `pending` below reach the
loop's private methods in one place.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from workers.kafka.changelog import ChangelogTable
from workers.kafka.config import KafkaConfig
from workers.kafka.stateful import EXIT_KAFKA_FAILURE, StageLoop

TOPIC = "in"


def record(partition: int, offset: int) -> ConsumerRecord:
    return ConsumerRecord(
        topic=TOPIC,
        partition=partition,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=b"",
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=0,
        headers=[],
    )


def batch(partition: int, *offsets: int) -> list[ConsumerRecord]:
    return [record(partition, o) for o in offsets]


class Stage:
    """The stage's side of the loop: keeps each batch it is given and answers each with the
    acknowledgement queued for it (None: settled before `process` returned)."""

    def __init__(self, *acks: Awaitable[None] | None) -> None:
        self.acks = list(acks)
        self.seen: list[list[tuple[int, int]]] = []

    async def process(self, records: list[ConsumerRecord]) -> Awaitable[None] | None:
        self.seen.append([(r.partition, r.offset) for r in records])
        return self.acks.pop(0) if self.acks else None


def make_loop(
    process: Callable[[list[ConsumerRecord]], Awaitable[Any]],
    *,
    tables: Iterable[Any] = (),
    on_assigned: Callable[[frozenset[int]], Any] | None = None,
    commit_metadata: Callable[[], Awaitable[str]] | None = None,
) -> StageLoop:
    return StageLoop(
        KafkaConfig(),
        stage="test",
        group_id="test-group",
        topic=TOPIC,
        tables=list(tables),
        process=process,
        on_assigned=on_assigned,
        batch_size=100,
        batch_within_s=0.0,
        commit_interval_s=60.0,
        session_timeout_s=10.0,
        commit_metadata=commit_metadata,
    )


# The loop's private seams, in one place.
async def feed(loop: StageLoop, records: list[ConsumerRecord]) -> None:
    """What `run` does with a fetched batch of assigned partitions (bounded: a loop that
    waits for an acknowledgement it should not wait for fails here rather than hangs)."""
    await asyncio.wait_for(loop._process(records), 2)


async def settle(loop: StageLoop) -> None:
    """Wait for every unsettled batch (what `revoked` and shutdown do before committing)."""
    await loop._settle()


def pending(loop: StageLoop) -> dict[int, int]:
    """partition → offset the loop would commit next."""
    assert {tp.topic for tp in loop._uncommitted} <= {TOPIC}
    return {tp.partition: offset for tp, offset in loop._uncommitted.items()}


async def ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class Exited(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The exit statuses the loop asked for; `os._exit` raises `Exited` instead of exiting."""
    statuses: list[int] = []

    def fake_exit(status: int) -> None:
        statuses.append(status)
        raise Exited(status)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    return statuses


# ------------------------------------------------------------------ offsets of a batch


async def test_a_settled_batch_commits_one_past_each_partitions_last_record() -> None:
    stage = Stage(None)
    loop = make_loop(stage.process)
    records = [*batch(0, 5, 6, 7), *batch(2, 10), *batch(0, 8)]
    await feed(loop, records)
    assert stage.seen == [[(0, 5), (0, 6), (0, 7), (2, 10), (0, 8)]]
    assert pending(loop) == {0: 9, 2: 11}


async def test_a_later_batch_moves_only_its_own_partitions() -> None:
    loop = make_loop(Stage().process)
    await feed(loop, batch(0, 0, 1) + batch(1, 4))
    await feed(loop, batch(1, 5, 6))
    assert pending(loop) == {0: 2, 1: 7}


async def test_an_empty_sweep_batch_reaches_the_stage_and_commits_nothing() -> None:
    stage = Stage()
    loop = make_loop(stage.process)
    await feed(loop, [])
    assert stage.seen == [[]]
    assert pending(loop) == {}


async def test_offsets_wait_for_the_batch_to_be_acknowledged() -> None:
    ack = asyncio.get_running_loop().create_future()
    loop = make_loop(Stage(ack).process)
    await feed(loop, batch(3, 40, 41))
    assert pending(loop) == {}
    ack.set_result(None)
    await settle(loop)
    assert pending(loop) == {3: 42}


async def test_the_next_batch_is_processed_while_the_previous_one_settles() -> None:
    running = asyncio.get_running_loop()
    first, second = running.create_future(), running.create_future()
    stage = Stage(first, second)
    loop = make_loop(stage.process)
    await feed(loop, batch(0, 0, 1))
    feeding = asyncio.create_task(feed(loop, batch(1, 7)))
    await ticks()
    # The second batch was handed to the stage, but the loop holds at most one batch
    # unsettled behind it: it waits for the first before fetching again.
    assert stage.seen == [[(0, 0), (0, 1)], [(1, 7)]]
    assert not feeding.done()
    assert pending(loop) == {}
    first.set_result(None)
    await asyncio.wait_for(feeding, 1)
    assert pending(loop) == {0: 2}
    second.set_result(None)
    await settle(loop)
    assert pending(loop) == {0: 2, 1: 8}


async def test_batches_settle_in_order_even_when_acknowledged_out_of_order() -> None:
    running = asyncio.get_running_loop()
    first, second = running.create_future(), running.create_future()
    loop = make_loop(Stage(first, second).process)
    await feed(loop, batch(0, 0, 1))
    feeding = asyncio.create_task(feed(loop, batch(0, 2, 3)))
    await ticks()
    second.set_result(None)
    await ticks()
    assert pending(loop) == {}, "the second batch may not pass the first, still unsettled"
    first.set_result(None)
    await asyncio.wait_for(feeding, 1)
    await settle(loop)
    assert pending(loop) == {0: 4}


async def test_a_settled_batch_behind_an_unsettled_one_waits_for_it() -> None:
    ack = asyncio.get_running_loop().create_future()
    loop = make_loop(Stage(ack, None).process)
    await feed(loop, batch(0, 0))
    feeding = asyncio.create_task(feed(loop, batch(1, 9)))
    await ticks()
    assert pending(loop) == {}, "a batch settled by `process` still waits for the one before"
    ack.set_result(None)
    await asyncio.wait_for(feeding, 1)
    await settle(loop)
    assert pending(loop) == {0: 1, 1: 10}


# ------------------------------------------------------------------ failures


async def test_a_failed_batch_exits_70_and_records_nothing(exits: list[int]) -> None:
    async def process(records: list[ConsumerRecord]) -> None:
        raise KafkaTimeoutError()

    loop = make_loop(process)
    with pytest.raises(Exited):
        await feed(loop, batch(0, 0, 1))
    assert exits == [EXIT_KAFKA_FAILURE] == [70]
    assert pending(loop) == {}


async def test_a_failed_acknowledgement_exits_70_at_once(exits: list[int]) -> None:
    ack = asyncio.get_running_loop().create_future()
    loop = make_loop(Stage(ack).process)
    await feed(loop, batch(0, 0, 1))
    ack.set_exception(KafkaTimeoutError())
    await ticks()
    # Nothing awaited the acknowledgement: the loop may be busy with the next batch.
    assert exits == [70]
    with pytest.raises(KafkaTimeoutError):
        await settle(loop)
    assert pending(loop) == {}


# ------------------------------------------------------------------ commit


async def test_offsets_of_partitions_no_longer_assigned_are_never_committed() -> None:
    loop = make_loop(Stage().process)
    loop.assigned = frozenset({0})
    await feed(loop, batch(1, 3, 4))
    assert pending(loop) == {1: 5}
    # No consumer exists: committing anything here would fail.
    await asyncio.wait_for(loop._commit(), 1)
    assert pending(loop) == {}


async def test_a_periodic_commit_does_not_wait_for_the_unsettled_batch() -> None:
    ack = asyncio.get_running_loop().create_future()
    loop = make_loop(Stage(ack).process)
    loop.assigned = frozenset({0})
    await feed(loop, batch(0, 0, 1))
    # Had the commit waited for the batch or taken its offsets, it would time out or reach
    # for the consumer (there is none).
    await asyncio.wait_for(loop._commit(), 1)
    ack.set_result(None)
    await settle(loop)
    assert pending(loop) == {0: 2}


class NoClient:
    """Where the loop keeps its consumer, on paths that must not use it: any use fails."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the loop used its Kafka client ({name}) on a pure path")


async def test_commit_metadata_goes_with_every_assigned_partition() -> None:
    async def metadata() -> str:
        return "M1"

    loop = make_loop(Stage().process, commit_metadata=metadata)
    loop.consumer = NoClient()  # type: ignore[assignment]
    loop.assigned = frozenset({0, 1})
    loop.committed = {0: OffsetAndMetadata(3, "old"), 1: OffsetAndMetadata(5, "old")}
    await feed(loop, batch(0, 3, 4) + batch(7, 1))
    offsets = await loop._offsets_with_metadata()
    assert offsets == {
        TopicPartition(TOPIC, 0): OffsetAndMetadata(5, "M1"),  # its new records
        TopicPartition(TOPIC, 1): OffsetAndMetadata(5, "M1"),  # its commit, fresh metadata
    }


async def test_unchanged_metadata_without_new_offsets_commits_nothing() -> None:
    current = ["M"]

    async def metadata() -> str:
        return current[0]

    loop = make_loop(Stage().process, commit_metadata=metadata)
    loop.consumer = NoClient()  # type: ignore[assignment]
    loop.assigned = frozenset({1})
    loop.committed = {1: OffsetAndMetadata(5, "old")}
    assert await loop._offsets_with_metadata() == {
        TopicPartition(TOPIC, 1): OffsetAndMetadata(5, "M")
    }
    assert await loop._offsets_with_metadata() == {}
    current[0] = "N"
    assert await loop._offsets_with_metadata() == {
        TopicPartition(TOPIC, 1): OffsetAndMetadata(5, "N")
    }


# ------------------------------------------------------------------ assignment


class Table:
    """The part of `ChangelogTable` the loop uses: its partitions, `drop`, `restore`."""

    def __init__(self, partitions: set[int], calls: list[tuple[str, list[int]]]) -> None:
        self.partitions = set(partitions)
        self.calls = calls

    def drop(self, partitions: Iterable[int]) -> None:
        self.calls.append(("drop", sorted(partitions)))
        self.partitions -= set(partitions)

    async def restore(self, partitions: Iterable[int]) -> int:
        self.calls.append(("restore", sorted(partitions)))
        self.partitions |= set(partitions)
        return 0


@pytest.mark.parametrize("is_async", [False, True], ids=["sync-hook", "async-hook"])
async def test_assignment_drops_lost_partitions_restores_then_tells_the_stage(
    is_async: bool,
) -> None:
    calls: list[tuple[str, list[int]]] = []
    tables = [Table({0, 1, 2}, calls), Table(set(), calls)]

    def hook(assigned: frozenset[int]) -> None:
        calls.append(("on_assigned", sorted(assigned)))

    async def async_hook(assigned: frozenset[int]) -> None:
        await asyncio.sleep(0)
        hook(assigned)

    loop = make_loop(Stage().process, tables=tables, on_assigned=async_hook if is_async else hook)
    await loop.assigned_now({1, 2, 3})
    assert calls == [
        ("drop", [0]),
        ("restore", [1, 2, 3]),
        ("drop", []),
        ("restore", [1, 2, 3]),
        ("on_assigned", [1, 2, 3]),
    ]
    assert loop.assigned == frozenset({1, 2, 3})
    assert [t.partitions for t in tables] == [{1, 2, 3}, {1, 2, 3}]


async def test_a_kept_partition_keeps_its_state_and_a_lost_one_is_forgotten() -> None:
    table = ChangelogTable(KafkaConfig(), "changelog", client_id="test")
    table.put(b"a", b"A", 0)
    table.put(b"b", b"B", 1)
    table.partitions = {0, 1}
    loop = make_loop(Stage().process, tables=[table])
    # Partition 1 is already in memory: nothing to read, so no client is made.
    await asyncio.wait_for(loop.assigned_now({1}), 1)
    assert table.items() == [(b"b", b"B", 1)]
    assert table.partitions == {1}
    assert loop.assigned == frozenset({1})


async def test_revocation_clears_the_assignment() -> None:
    loop = make_loop(Stage().process)
    await loop.assigned_now({0, 1})
    await asyncio.wait_for(loop.revoked({0, 1}), 1)
    assert loop.assigned == frozenset()


# ------------------------------------------------------------------ exit status


async def test_serve_exits_70_when_the_broker_cannot_be_reached() -> None:
    calls: list[str] = []

    async def start() -> None:
        calls.append("start")
        raise KafkaConnectionError("no broker")

    async def close() -> None:
        calls.append("close")

    assert await make_loop(Stage().process).serve(start, close) == 70
    assert calls == ["start", "close"]


@pytest.mark.parametrize(
    ("failure", "status"),
    [(None, 0), (KafkaTimeoutError(), 70), (RuntimeError("bug"), 1)],
    ids=["clean", "kafka-error", "other-error"],
)
async def test_serve_maps_how_the_run_ended_to_an_exit_status(
    monkeypatch: pytest.MonkeyPatch, failure: Exception | None, status: int
) -> None:
    calls: list[str] = []
    loop = make_loop(Stage().process)

    async def start() -> None:
        calls.append("start")

    async def run() -> None:
        calls.append("run")
        if failure is not None:
            raise failure

    async def close() -> None:
        calls.append("close")

    monkeypatch.setattr(loop, "run", run)
    assert await loop.serve(start, close) == status
    assert calls == ["start", "run", "close"]
