"""The reward stage: `rl.turns` → one `ScoredTrajectory` per trajectory, on a `StageLoop`.

The loop (`workers.kafka.stateful`) consumes `rl.turns` as one consumer group in batches, and
per batch:

1. decodes each turn (undecodable → `rl.dlq`), and folds it into the trajectory's state in
   the trajectories table (a `ChangelogTable` keyed by trajectory id; `assembler` has the
   rules);
2. scores the trajectories that became complete, concurrently (`dispatch`);
3. persists, and awaits the broker's acknowledgement of, every changed unfinished state and
   an EMITTING marker for each output (holding the end offset of the output's partition);
4. produces the outputs to `rl.scored` (key uid, header `rl.trajectory_id`) and dead letters
   to `rl.dlq` with an idempotent acks=all producer, and awaits every acknowledgement;
5. marks the trajectories DONE (changelog write, not awaited).

Changelog records are written by the stage's own producer (on the source partition), so
every write's acknowledgement can be awaited; the table is restored from that topic on start
and whenever the group's assignment changes.

Only then does the loop record the batch's offsets for its next commit. So an offset is
committed only after everything it caused is acknowledged (at-least-once on the input).

Exactly once on `rl.scored`: a trajectory is emitted only when its state is not DONE or
EMITTING. A redelivered turn after a crash finds either DONE (dropped), or EMITTING — then
the stage reads the output partition from the recorded offset (`ledger`) and emits only if
the output is not there. The only way to get a duplicate is the broker accepting an output
whose acknowledgement the stage never saw *and* the record landing after the restart's scan
(seconds later); consumers can still de-duplicate by `trajectory_id`. Dead letters are
at-least-once. Any failure to talk to Kafka ends the process at once (exit 70) without
committing a half-processed batch; restart it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from schemas.codec import decode_as, encode, headers_for
from schemas.deadletter import DeadLetter
from schemas.errors import DecodeError
from schemas.events import ScoredTrajectory, TurnEvent
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.stateful import ChangelogTable, StageLoop
from workers.metrics import StageMetrics
from workers.reward.assembler import Assembled, TrajectoryState, apply_turn, assemble
from workers.reward.config import RewardConfig
from workers.reward.dispatch import Dispatcher, Score
from workers.reward.exceptions import RewardError, ScorerTimeout, UnknownDataSource
from workers.reward.ledger import TRAJECTORY_HEADER, OutputLedger
from workers.reward.letters import STAGE, record_letter, trajectory_letter
from workers.reward.pool import ScorerPool
from workers.reward.rm_client import RewardModelClient
from workers.reward.stats import RewardStats

__all__ = ["STAGE", "RewardStage"]

log = logging.getLogger("rollout.reward")

_CHANGES = {"added", "complete", "replaced_attempt"}


class RewardStage:
    """The stage's loop and table, and the clients its batches produce with."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        config: RewardConfig,
        *,
        tokenizer: Any | None,
        metrics: StageMetrics | None = None,
    ) -> None:
        self.kafka = kafka
        self.config = config
        self.turns_topic_name = topics.name("turns")
        self.scored_topic = topics.name("scored")
        self.dlq_topic = topics.name("dlq")
        self.tokenizer = tokenizer
        self.stats = RewardStats(config.stats_path)
        # Fed where `stats` counts; in flight = trajectories with turns seen, not yet finished.
        self.metrics = metrics or StageMetrics("reward")
        self._assembling: set[bytes] = set()
        self.metrics.watch(in_flight=lambda: len(self._assembling))
        self.client_id = f"{kafka.client_id}-{config.app_id}"
        self.table = ChangelogTable(kafka, config.changelog_topic, client_id=self.client_id)
        self.loop = StageLoop(
            kafka, stage="reward", group_id=config.app_id, topic=self.turns_topic_name,
            tables=[self.table], process=self.process, on_assigned=self._on_assigned,
            batch_size=config.batch_size, batch_within_s=config.batch_within_s,
            commit_interval_s=config.commit_interval_s,
            session_timeout_s=config.session_timeout_s,
        )  # fmt: skip
        self.producer: AIOKafkaProducer | None = None
        self.ledger: OutputLedger | None = None
        self.pool: ScorerPool | None = None
        self.dispatcher: Dispatcher | None = None
        self._last_log = time.monotonic()

    # --- lifecycle -------------------------------------------------------------------

    def _needs_pool(self) -> bool:
        c = self.config
        if c.scorer_kind == "rule":
            return "math" in c.data_sources.values()
        return c.scorer_kind == "custom" and c.custom is not None and c.custom.executor == "process"

    async def run(self) -> int:
        """Start the clients, run the loop until SIGTERM/SIGINT; the exit status."""
        status = await self.loop.serve(self.start_clients, self.close)
        log.info("reward stage stopped (%d): %s", status, self.stats.snapshot())
        return status

    async def start_clients(self) -> None:
        """Producer, ledger, scorer pool and reward-model client (before the group join)."""
        client_id = self.client_id
        self.producer = AIOKafkaProducer(
            **self.kafka.aiokafka_kwargs(),
            client_id=f"{client_id}-out",
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            # aiokafka's default (16 KiB) puts each trajectory in its own batch.
            max_batch_size=1024 * 1024,
            max_request_size=self.kafka.max_request_size,
        )
        await self.producer.start()
        self.table.producer = self.producer
        self.ledger = OutputLedger(self.kafka, self.scored_topic, client_id=f"{client_id}-ledger")
        await self.ledger.start(self.producer)
        if self._needs_pool():
            self.pool = ScorerPool(self.config.pool_workers)
            await self.pool.start()
        rm = self.config.reward_model
        client = None
        if rm.enable and rm.style == "discriminative" and self.config.custom is None:
            client = RewardModelClient(rm.addresses, timeout_s=rm.timeout_s, max_batch=rm.max_batch)
        self.dispatcher = Dispatcher(
            self.config, tokenizer=self.tokenizer, pool=self.pool, reward_model=client
        )
        log.info(
            "reward stage ready: scorer=%s pool=%s", self.config.scorer_kind, self.pool is not None
        )

    async def close(self) -> None:
        if self.dispatcher is not None:
            await self.dispatcher.close()
        if self.pool is not None:
            await self.pool.close()
        if self.ledger is not None:
            await self.ledger.stop()
        if self.producer is not None:
            await self.producer.stop()

    def _on_assigned(self, assigned: frozenset[int]) -> None:
        # States of partitions gone elsewhere no longer count as in flight here.
        self._assembling &= set(self.table.data)

    # --- one batch -------------------------------------------------------------------

    def _load(self, key: bytes) -> TrajectoryState | None:
        raw = self.table.get(key)
        return TrajectoryState.from_bytes(raw) if raw else None

    def _write(self, key: bytes, state: TrajectoryState, partition: int) -> Any:
        """Set the table entry and send it to the changelog partition of its source partition.

        One producer for every write keeps a trajectory's writes in order; the coroutine's
        result is the broker's acknowledgement future.
        """
        return self.table.write(key, state.to_bytes(), partition)

    async def process(self, records: list[ConsumerRecord]) -> None:
        """Assemble, score, persist and emit one batch (steps 1–5 of the module doc)."""
        started = time.monotonic()
        assert self.producer is not None and self.dispatcher is not None
        self.stats.add("batches")
        self._background: list[Any] = []  # DONE writes: enqueued, acks not awaited
        pending: list[Any] = []  # broker futures of phase 2 (outputs and dead letters)
        decoded: list[tuple[Any, TurnEvent, bytes]] = []
        self.stats.add("turns", len(records))
        self.metrics.consumed(self.turns_topic_name, len(records))
        for record in records:
            try:
                turn = decode_as(record.value, TurnEvent)
                key = record.key
                if key is not None and key != turn.trajectory_id.encode():
                    # A mis-keyed turn sits in another partition than its trajectory.
                    raise DecodeError(
                        f"record key {key!r} is not the turn's trajectory id {turn.trajectory_id!r}",
                        cause="key_mismatch",
                    )
            except DecodeError as exc:
                self.stats.add("decode_errors")
                pending.append(await self._send_letter(record_letter(record, exc)))
                continue
            decoded.append((record, turn, record.value))

        states: dict[bytes, TrajectoryState | None] = {}
        first: dict[bytes, Any] = {}  # key → first message of it in this batch
        persisted: dict[bytes, tuple[str, set[int]]] = {}  # key → attempt, turns in the table
        fresh: dict[tuple[bytes, str, int], TurnEvent] = {}  # decoded in this batch
        for message, turn, _ in decoded:
            key = turn.trajectory_id.encode()
            fresh.setdefault((key, turn.attempt_id, turn.turn_index), turn)
            if key not in states:
                loaded = states[key] = self._load(key)
                first[key] = message
                if loaded is not None:
                    persisted[key] = (loaded.attempt_id, set(loaded.turns))
        self.stats.timing("t_decode", started)
        dirty, completed = await self._resolve_emitting(states, first)
        for message, turn, raw in decoded:
            key = turn.trajectory_id.encode()
            state, outcome = apply_turn(states[key], turn, raw)
            states[key] = state
            self.stats.add(outcome)
            if outcome in _CHANGES:
                dirty.add(key)
            if outcome == "complete":
                completed[key] = message

        drafts: list[tuple[bytes, Any, Assembled]] = []
        unassembled: list[bytes] = []
        for key, message in completed.items():
            state = states[key]
            assert state is not None
            try:
                known = {
                    i: fresh[key, state.attempt_id, i]
                    for i in state.turns
                    if (key, state.attempt_id, i) in fresh
                }
                drafts.append((key, message, assemble(state, known)))
            except DecodeError as exc:
                raw_final = state.turns[state.final_index or 0]
                pending.append(
                    await self._send_letter(record_letter(message, exc, value=raw_final))
                )
                unassembled.append(key)
        mark = time.monotonic()
        results = await self.dispatcher.score_batch([d[2] for d in drafts])
        mark = self.stats.timing("t_score", mark)

        outputs: list[tuple[bytes, ScoredTrajectory, str]] = []
        letters: list[tuple[bytes, Any, ScoredTrajectory, RewardError]] = []
        for (key, message, draft), result in zip(drafts, results, strict=True):
            if isinstance(result, Score):
                scored = ScoredTrajectory(
                    **draft.fields, reward_score=result.value, reward_extra=result.extra
                )
                outputs.append((key, scored, "scored"))
                continue
            self.stats.add(
                "scorer_timeouts" if isinstance(result, ScorerTimeout) else "scorer_errors"
            )
            if isinstance(result, UnknownDataSource):
                self.stats.add("unknown_data_source")
            tagged = ScoredTrajectory(
                **draft.fields,
                reward_score=self.config.failure_score,
                reward_extra={
                    "reward_failed": True,
                    "reward_error_class": getattr(result, "error_class", type(result).__name__),
                    "reward_error_cause": result.cause,
                    "reward_error": str(result)[:1000],
                },
            )
            if self.config.on_failure == "score" and not isinstance(result, UnknownDataSource):
                outputs.append((key, tagged, "failure_scored"))
            else:
                letters.append((key, message, tagged, result))

        # Phase 1: unfinished states and EMITTING markers, acknowledged before any output.
        partitions: dict[bytes, int] = {}
        if outputs:
            assert self.ledger is not None
            for key, scored, _ in outputs:
                partitions[key] = self.ledger.partition_for(scored.uid)
            ends = await self.ledger.end_offsets(set(partitions.values()))
            for key, _, _ in outputs:
                state = states[key]
                assert state is not None
                state.status = "emitting"
                state.emit_since = {partitions[key]: ends[partitions[key]]}
                dirty.add(key)
        marks = []
        for key in dirty:
            state = states[key]
            assert state is not None
            if state.status == "emitting":
                attempt, kept = persisted.get(key, ("", set()))
                marker = state.marker(
                    state.emit_since or {}, kept if attempt == state.attempt_id else set()
                )
                marks.append(self._write(key, marker, first[key].partition))
            elif state.status == "assembling" and not state.complete:
                marks.append(self._write(key, state, first[key].partition))
        if marks:
            await asyncio.gather(*await asyncio.gather(*marks))
        mark = self.stats.timing("t_persist", mark)

        # Phase 2: outputs and dead letters, every acknowledgement awaited.
        for key, scored, _ in outputs:
            headers = [*headers_for(scored), (TRAJECTORY_HEADER, scored.trajectory_id.encode())]
            pending.append(
                await self.producer.send(
                    self.scored_topic,
                    encode(scored),
                    key=scored.uid.encode(),
                    partition=partitions[key],
                    headers=headers,
                )
            )
        for _, message, tagged, error in letters:
            pending.append(await self._send_letter(trajectory_letter(message, tagged, error)))
        if pending:
            await asyncio.gather(*pending)
        self.stats.timing("t_emit", mark)
        self._observe_outputs(outputs, {key: draft.started_at for key, _, draft in drafts})

        # Phase 3: DONE markers (not awaited: a lost one leaves EMITTING, which resolves).
        for key, _, outcome in outputs:
            self._finish(states, key, outcome, first[key].partition)
        for key, _, _, _ in letters:
            self._finish(states, key, "dead_lettered", first[key].partition)
        for key in unassembled:
            self._finish(states, key, "dead_lettered", first[key].partition)
        for write in self._background:
            await write
        for key, state in states.items():
            if state is not None and state.status == "assembling":
                self._assembling.add(key)
            else:
                self._assembling.discard(key)
        self._after_batch(started)

    def _observe_outputs(
        self, outputs: list[tuple[bytes, ScoredTrajectory, str]], started: dict[bytes, float | None]
    ) -> None:
        """Acknowledged outputs: counted, and timed from their turn 0's creation."""
        now = time.time()
        self.metrics.produced(self.scored_topic, len(outputs))
        for key, _, _ in outputs:
            first_turn = started.get(key)
            if first_turn is not None:
                self.metrics.observe_trajectory(now - first_turn)

    def _finish(
        self, states: dict[bytes, TrajectoryState | None], key: bytes, outcome: str, partition: int
    ) -> None:
        state = states[key]
        assert state is not None
        state.mark_done(outcome)
        self.stats.add(outcome)
        self._background.append(self._write(key, state, partition))

    async def _resolve_emitting(
        self, states: dict[bytes, TrajectoryState | None], first: dict[bytes, Any]
    ) -> tuple[set[bytes], dict[bytes, Any]]:
        """EMITTING states (left by a crash): DONE if the output is on rl.scored, else rescore."""
        marked = {k: s for k, s in states.items() if s is not None and s.status == "emitting"}
        if not marked:
            return set(), {}
        assert self.ledger is not None
        by_partition: dict[int, dict[bytes, int]] = {}
        for key, state in marked.items():
            for partition, offset in (state.emit_since or {}).items():
                by_partition.setdefault(partition, {})[key] = offset
        found: set[str] = set()
        for partition, offsets in by_partition.items():
            wanted = {k.decode() for k in offsets}
            found |= await self.ledger.emitted_since(partition, min(offsets.values()), wanted)
        dirty: set[bytes] = set()
        rescore: dict[bytes, Any] = {}
        for key, state in marked.items():
            if key.decode() in found:
                state.mark_done("scored")
                self.stats.add("emit_recovered_present")
                self._background.append(self._write(key, state, first[key].partition))
            else:
                # Not emitted: assemble again. A marker holds only the turns persisted before
                # its batch; the rest are being redelivered and complete it via apply_turn.
                state.status, state.emit_since = "assembling", None
                self.stats.add("emit_recovered_missing")
                if state.complete:
                    rescore[key] = first[key]
                dirty.add(key)
        return dirty, rescore

    async def _send_letter(self, letter: DeadLetter) -> Any:
        assert self.producer is not None
        log.warning(
            "dead-lettering %s[%d]@%d: %s (%s): %s",
            letter.topic, letter.partition, letter.offset,
            letter.error_class, letter.error_cause, letter.error_message[:200],
        )  # fmt: skip
        self.metrics.dead_letter(letter.error_class, self.dlq_topic)
        return await self.producer.send(
            self.dlq_topic, letter.value, key=letter.key, headers=letter.headers()
        )

    def _after_batch(self, started: float) -> None:
        self.stats.last_batch_s = time.monotonic() - started
        self.stats.timing("t_batch", started)
        extra = self.pool.stats() if self.pool is not None else None
        self.stats.write(extra)
        now = time.monotonic()
        if now - self._last_log > 30:
            self._last_log = now
            log.info("reward stats: %s", self.stats.snapshot())
