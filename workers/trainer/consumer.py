"""`TrajectoryConsumer`: the public way for a trainer (or evaluator, exporter) to read trajectories.

    with TrajectoryConsumer(kafka, topics, topic="replay", group_id="my-trainer") as src:
        for batch in src.batches(8):           # 8 TrainingGroups → one padded torch batch
            train_step(batch["input_ids"], batch["response_mask"], batch["advantages"], ...)
            src.commit()                       # explicit: only what was handed out

`topic="replay"` yields `TrainingGroup`s (with the replay stage's advantages), `topic="scored"`
yields `ScoredTrajectory`s (advantages 0 unless `advantages="grpo"`, GRPO's with the replay
stage's defaults, or `advantages=cfg.replay`, the run's replay settings: then they equal what
the replay stage puts on `rl.replay` for the same group, Dr. GRPO's `norm_adv_by_std: false`
included). A record that does not
decode into that kind goes to the dead-letter topic (acknowledged before anything after it is
handed out) and is skipped; it never stops the consumer.

Positions. `positions()` maps `"topic:partition"` → the offset after the last record *handed
out* (not merely fetched), so storing positions with the state a consumer built from the
records handed out, and later `seek(positions)` (or `positions=` at construction), resumes
exactly after them: no record twice, none skipped. `commit()` writes the same positions to
the consumer group. Two modes:

- `assign=True` (what the trainer uses): every partition of the topic is assigned to this
  consumer; no group membership, no rebalances; the group id only names committed offsets.
- `assign=False`: subscribe with the group; Kafka balances partitions over the group's
  members. Seeks for partitions not assigned yet apply when they are; records buffered from a
  revoked partition are dropped (its new owner restarts from the committed offset).

Not thread-safe (kafka-python's consumer is not). Torch is imported only by `batches()`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kafka import ConsumerRebalanceListener, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from schemas.codec import decode
from schemas.errors import DecodeError
from schemas.events import ScoredTrajectory, TrainingGroup
from workers.kafka.clients import ack_wait_s, make_consumer, make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.dlq import KafkaDeadLetters
from workers.kafka.exceptions import KafkaUnavailableError
from workers.kafka.retry import call_retrying
from workers.metrics import StageMetrics
from workers.trainer.batching import TrajectoryBatch, collate, collate_groups
from workers.trainer.exceptions import ConsumerClosedError
from workers.trainer.whole_groups import REPLAY_DEFAULTS, AdvantageSettings

__all__ = ["AdvantageSettings", "ConsumerClosedError", "Item", "TrajectoryConsumer", "position_key"]

log = logging.getLogger("rollout.trainer.consumer")

_KINDS: dict[str, type] = {"replay": TrainingGroup, "scored": ScoredTrajectory}


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Item:
    """One handed-out event with where it came from (and its original bytes and headers)."""

    event: Any
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


def position_key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def _parse_key(key: str) -> TopicPartition:
    topic, _, partition = key.rpartition(":")
    return TopicPartition(topic, int(partition))


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: TrajectoryConsumer) -> None:
        self.owner = owner

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.owner._forget(set(revoked))

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.owner._apply_pending(set(assigned))


class TrajectoryConsumer:
    """Typed events or padded torch batches from `rl.replay` / `rl.scored`; see the module doc."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        *,
        topic: Literal["replay", "scored"] = "replay",
        group_id: str | None,
        assign: bool = False,
        positions: Mapping[str, int] | None = None,
        name: str = "trajectory-consumer",
        metrics: StageMetrics | None = None,
        **consumer_overrides: Any,
    ) -> None:
        if topic not in _KINDS:
            raise ValueError(f"topic must be 'replay' or 'scored', not {topic!r}")
        self.kind = _KINDS[topic]
        self.topic = topics.name(topic)
        self.name = name
        self.metrics = metrics  # counts records fetched and dead letters, when given
        self._kafka = kafka
        self._dlq_topic = topics.name("dlq")
        self._dlq: KafkaDeadLetters | None = None
        self._producer: KafkaProducer | None = None
        self._buffer: deque[tuple[TopicPartition, int, Item | None]] = deque()
        self._positions: dict[TopicPartition, int] = {}
        # Partitions whose records are held back (whole GRPO groups): the position reported
        # stays here until they are handed out (`whole_groups.grpo_batches`).
        self._hold: dict[TopicPartition, int] = {}
        self.partial_groups = 0  # GRPO groups handed out (or left) incomplete
        self._pending: dict[TopicPartition, int] = {}
        self._state = _State.OPEN
        self.handed_out = 0
        self._consumer = make_consumer(kafka, group_id=group_id, name=name, **consumer_overrides)
        try:
            if assign:
                self._assign_all()
            else:
                self._consumer.subscribe([self.topic], listener=_Listener(self))
            if positions:
                self.seek(positions)
            if assign:
                # Every assigned partition gets a position now (committed offset or reset), so
                # `positions()` is complete even for partitions nothing was read from yet.
                for tp in self._consumer.assignment():
                    if tp not in self._positions:
                        self._positions[tp] = int(self._consumer.position(tp, timeout_ms=30_000))
        except BaseException:
            self._consumer.close()
            raise

    # --- reading ---------------------------------------------------------------------

    def next_item(self, timeout_s: float = 1.0) -> Item | None:
        """The next event with its record, or None if none arrived within `timeout_s`."""
        self._check_open()
        deadline = time.monotonic() + timeout_s
        while True:
            self._skip_dead()
            if self._buffer:
                tp, nxt, item = self._buffer.popleft()
                self._positions[tp] = nxt
                self.handed_out += 1
                self._skip_dead()
                return item
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._fill(left)

    def next(self, timeout_s: float = 1.0) -> Any | None:
        """The next event (`TrainingGroup` or `ScoredTrajectory`), or None on timeout."""
        item = self.next_item(timeout_s)
        return item.event if item is not None else None

    def take(self, n: int, timeout_s: float = 1.0) -> list[Any]:
        """Up to `n` events, waiting at most `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        out: list[Any] = []
        while len(out) < n:
            event = self.next(max(0.0, deadline - time.monotonic()))
            if event is None:
                break
            out.append(event)
        return out

    def __iter__(self) -> Iterator[Any]:
        """Events forever (blocking); stop by breaking out of the loop."""
        while True:
            event = self.next(1.0)
            if event is not None:
                yield event

    def batches(
        self,
        size: int,
        *,
        max_wait_s: float | None = None,
        pad_token_id: int = 0,
        advantages: Literal["zero", "grpo"] | AdvantageSettings = "zero",
        group_timeout_s: float | None = 600.0,
    ) -> Iterator[TrajectoryBatch]:
        """Padded batches of `size` events (groups for replay, trajectories for scored).

        With `max_wait_s`, ends (after yielding what it holds as a last, smaller batch) once
        no event arrived for that long; without, it blocks for ever. `advantages` applies to
        scored trajectories only: 'zero', or GRPO's — 'grpo' (the replay stage's default
        settings) or the run's replay settings (`advantages=cfg.replay`: `norm_adv_by_std`,
        `adv_eps`, so they equal `rl.replay`'s for the same group) — then a batch holds at
        least `size` *whole groups* (`whole_groups.grpo_batches`: a GRPO advantage over part
        of a group is wrong), a group incomplete after `group_timeout_s` is handed out as it
        is, and one still incomplete when the stream ends is not handed out at all; both are
        counted in `partial_groups` and said in a warning.
        """
        if size < 1:
            raise ValueError("size must be >= 1")
        if advantages != "zero" and self.kind is ScoredTrajectory:
            from workers.trainer.whole_groups import grpo_batches

            settings = REPLAY_DEFAULTS if advantages == "grpo" else advantages
            assert not isinstance(settings, str)
            yield from grpo_batches(
                self,
                size,
                max_wait_s,
                group_timeout_s,
                pad_token_id,
                norm_by_std=settings.norm_adv_by_std,
                eps=settings.adv_eps,
            )
            return
        events: list[Any] = []
        while True:
            event = self.next(max_wait_s if max_wait_s is not None else 1.0)
            if event is None and max_wait_s is None:
                continue
            if event is not None:
                events.append(event)
            if events and (len(events) == size or event is None):
                yield self._collate(events, pad_token_id)
                events = []
            if event is None:
                return

    def _collate(self, events: list[Any], pad: int) -> TrajectoryBatch:
        """Groups with their advantages, or scored trajectories with advantages 0 (GRPO's
        are `grpo_batches`', over whole groups)."""
        if self.kind is TrainingGroup:
            return collate_groups(events, pad_token_id=pad)
        return collate(events, None, pad_token_id=pad)

    # --- positions -------------------------------------------------------------------

    def positions(self) -> dict[str, int]:
        """`"topic:partition"` → offset after the last record handed out (JSON-ready)."""
        return {
            position_key(tp.topic, tp.partition): min(off, self._hold.get(tp, off))
            for tp, off in self._positions.items()
        }

    def backlog(self) -> int:
        """Records not handed out yet: buffered here or still on the broker, from each
        partition's position to its end offset (one request to the broker). A count to decide
        by (a lending trainer: `workers.trainer.lend`), not a guarantee: a broker that does not
        answer gives what is buffered."""
        self._check_open()
        if not self._positions:
            return len(self._buffer)
        try:
            ends = self._consumer.end_offsets(list(self._positions))
        except KafkaError as exc:
            log.debug(
                "end offsets of %s not read (%s): backlog is what is buffered", self.topic, exc
            )
            return len(self._buffer)
        return sum(max(0, int(ends.get(tp, off)) - off) for tp, off in self._positions.items())

    def seek(self, positions: Mapping[str, int]) -> None:
        """Continue each partition at its offset (now if assigned, else once it is)."""
        self._check_open()
        assigned = set(self._consumer.assignment())
        for key, offset in positions.items():
            tp = _parse_key(key)
            if tp.topic != self.topic:
                continue
            self._drop_buffered(tp)
            if tp in assigned:
                self._consumer.seek(tp, int(offset))
                self._positions[tp] = int(offset)
            else:
                self._pending[tp] = int(offset)

    def commit(self, positions: Mapping[str, int] | None = None) -> dict[str, int]:
        """Commit positions to the consumer group (default: the handed-out ones); returns them.

        Pass earlier `positions()` to commit less than was handed out (the trainer commits the
        positions its last checkpoint covers, not records it holds but has not trained).
        """
        self._check_open()
        chosen = {_parse_key(k): int(v) for k, v in (positions or self.positions()).items()}
        offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in chosen.items()}
        if offsets:
            try:
                # A coordinator that moved or froze: asked again (kafka-python gives up on a
                # commit after request_timeout_ms); a rebalanced group is not transient.
                call_retrying(lambda: self._consumer.commit(offsets), f"commit on {self.topic}")
            except KafkaError as exc:
                raise KafkaUnavailableError(f"commit on {self.topic} failed: {exc}") from exc
        return {position_key(tp.topic, tp.partition): o.offset for tp, o in offsets.items()}

    # --- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        try:
            if self._producer is not None:
                self._producer.flush(timeout=ack_wait_s(self._kafka))
                self._producer.close()
        finally:
            self._consumer.close()

    def __enter__(self) -> TrajectoryConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise ConsumerClosedError(f"{self.name} is closed")

    def _assign_all(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            parts = self._consumer.partitions_for_topic(self.topic)
            if parts:
                break
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(
                    f"topic {self.topic} has no partitions (does it exist?)"
                )
            time.sleep(0.2)
        self._consumer.assign([TopicPartition(self.topic, p) for p in sorted(parts)])

    def _skip_dead(self) -> None:
        """Hand out (advance past) dead-lettered records at the head of the buffer."""
        while self._buffer and self._buffer[0][2] is None:
            tp, nxt, _ = self._buffer.popleft()
            self._positions[tp] = nxt

    def _fill(self, timeout_s: float) -> None:
        batches = self._consumer.poll(timeout_ms=max(1, int(timeout_s * 1000)))
        pending = []
        for tp, records in batches.items():
            for record in records:
                entry: Item | None = None
                if self.metrics is not None:
                    self.metrics.consumed(record.topic)
                try:
                    event = decode(record.value)
                    if not isinstance(event, self.kind):
                        raise DecodeError(
                            f"{type(event).__name__} does not belong on {record.topic} "
                            f"(expected {self.kind.__name__})",
                            cause="wrong_kind",
                        )
                    uid = event.uid.encode()
                    if record.key is not None and record.key != uid:
                        raise DecodeError(
                            f"record key {record.key!r} is not the event's uid {event.uid!r}",
                            cause="key_mismatch",
                        )
                    entry = Item(
                        event,
                        record.topic,
                        record.partition,
                        record.offset,
                        record.key,
                        record.value,
                        list(record.headers or []),
                    )
                except DecodeError as exc:
                    pending.append(self._dead_letters().send_record(record, exc))
                self._buffer.append((tp, record.offset + 1, entry))
        for future in pending:
            future.get(timeout=ack_wait_s(self._kafka))

    def _dead_letters(self) -> KafkaDeadLetters:
        if self._dlq is None:
            self._producer = make_producer(self._kafka, name=f"{self.name}-dlq")
            self._dlq = KafkaDeadLetters(
                self._producer, self._dlq_topic, stage=self.name, metrics=self.metrics
            )
        return self._dlq

    def _drop_buffered(self, tp: TopicPartition) -> None:
        self._buffer = deque(e for e in self._buffer if e[0] != tp)

    def _forget(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            self._drop_buffered(tp)
            self._positions.pop(tp, None)

    def _apply_pending(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned & set(self._pending):
            offset = self._pending.pop(tp)
            self._consumer.seek(tp, offset)
            self._positions[tp] = offset
