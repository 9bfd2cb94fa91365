"""One batch of the reward stage: turns in, complete trajectories scored and produced.

`TurnProcessor.process(records)` takes one batch of `rl.turns` records and:

1. decodes each turn (undecodable, or key ≠ trajectory id → `rl.dlq`) and folds it into its
   trajectory's state from the table (`assembler` has the rules);
2. takes the trajectories that became complete: one already on `rl.scored` since the
   recovery point (`recovered`, after a crash) is only marked DONE; the others are
   assembled and scored, concurrently (`dispatch`);
   Turn 0 of another prompt under a uid the stage holds (`duplicate_uid`) goes to `rl.dlq`
   with that cause;
3. sends every changed unfinished state to the changelog, each output to `rl.scored` (key
   uid, header `rl.trajectory_id`) and each dead letter to `rl.dlq`, and marks their
   trajectories DONE in memory, so later batches drop their turns;

and returns without waiting for the broker. What it returns settles the batch: it awaits
every acknowledgement, then persists the DONE states and awaits those too. The stage's loop
commits the batch's offsets only once it has settled, and processes the next batch
meanwhile. A DONE state therefore reaches the changelog only after its output is
acknowledged, and an offset is committed only after everything it caused is.

Exactly once on `rl.scored`: after a crash, the turns of the uncommitted batches come again.
A trajectory whose DONE state was persisted drops them; one whose output landed but whose
DONE did not is in `recovered` (read from `rl.scored` since the commit's recovery point) and
is marked DONE without a second output. The only way to get a duplicate is the broker
accepting an output whose acknowledgement the stage never saw *and* the record landing after
the restart's scan (seconds later); consumers can still de-duplicate by `trajectory_id`.
Dead letters are at-least-once.

A DONE state is kept for `done_retention_s` after its batch settled (an hour by default:
late turns come from redeliveries and restarted attempts, within minutes), then deleted
from the table and its changelog (a tombstone), so that neither grows with every
trajectory ever scored and a restarted stage restores only the recent ones. A turn of a
trajectory whose DONE state is gone starts it afresh.

A trajectory still assembling with no new turn for `abandon_after_s` (two hours by
default) is abandoned: its agent loop died and nothing restarted the attempt. Each turn
it holds goes to `rl.dlq` byte for byte (cause `abandoned`, so the trajectory can be
replayed from the dead letters), and its state is deleted the same way. Every batch sweeps
for both; with no turns arriving, the loop hands `process` an empty batch every
`sweep_interval_s`, so an idle stage sweeps too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from schemas.codec import decode_as, encode, headers_for
from schemas.deadletter import DeadLetter
from schemas.errors import DecodeError, DuplicateUidError
from schemas.events import ScoredTrajectory, TurnEvent
from schemas.headers import REWARD_FAILURE, TRAJECTORY_ID
from workers.kafka.changelog import ChangelogTable
from workers.kafka.dlq import AioDeadLetters
from workers.metrics import StageMetrics
from workers.reward.assembler import Assembled, TrajectoryState, apply_turn, assemble
from workers.reward.config import RewardConfig
from workers.reward.dispatch import Dispatcher, Score
from workers.reward.exceptions import (
    RewardError,
    ScorerTimeout,
    UnknownDataSource,
    VerdictError,
)
from workers.reward.ledger import ScoredLedger
from workers.reward.letters import STAGE, abandoned_letter, record_letter, trajectory_letter
from workers.reward.overlong import overlong_penalty
from workers.reward.stats import RewardStats

__all__ = ["TurnProcessor"]

log = logging.getLogger("rollout.reward")

_CHANGES = {"added", "complete", "replaced_attempt"}
# A batch is CPU work; the previous batch settles on the event loop between its steps.
_YIELD_EVERY = 128


class TurnProcessor:
    """The work of each batch, over the stage's table and clients."""

    def __init__(
        self,
        config: RewardConfig,
        table: ChangelogTable,
        *,
        producer: AIOKafkaProducer,
        ledger: ScoredLedger,
        dispatcher: Dispatcher,
        stats: RewardStats,
        metrics: StageMetrics,
        topics: tuple[str, str, str],
    ) -> None:
        self.config, self.table = config, table
        self.producer, self.ledger, self.dispatcher = producer, ledger, dispatcher
        self.stats, self.metrics = stats, metrics
        self.turns_topic, self.scored_topic, self.dlq_topic = topics
        self.letters = AioDeadLetters(producer, self.dlq_topic, stage=STAGE, metrics=metrics)
        self.recovered: set[str] = set()  # trajectory ids on rl.scored since the recovery point
        # Trajectories with turns seen, not yet finished, oldest last write first: key →
        # (its state's last write, partition). One idle past `abandon_after_s` is abandoned.
        self.assembling: dict[bytes, tuple[float, int]] = {}
        # Persisted DONE states, oldest first: (finished at, key, partition); deleted after
        # `done_retention_s`.
        self.expiry: deque[tuple[float, bytes, int]] = deque()

    def reindex(self) -> None:
        """Rebuild `expiry` and `assembling` from the table (after the assignment changed).
        A state written by an older stage has no time: its clock starts now."""
        now = time.time()
        done: list[tuple[float, bytes, int]] = []
        live: list[tuple[float, bytes, int]] = []
        for key, value, partition in self.table.items():
            state = TrajectoryState.from_bytes(value)
            if state.status == "done":
                done.append((state.done_at or now, key, partition))
            else:
                live.append((state.updated_at or now, key, partition))
        self.expiry = deque(sorted(done))
        self.assembling = {key: (written, partition) for written, key, partition in sorted(live)}

    async def _expire(self) -> list[Any]:
        """Delete the DONE states past their retention; the tombstones' ack futures."""
        horizon = time.time() - self.config.done_retention_s
        acks = []
        while self.expiry and self.expiry[0][0] <= horizon:
            _, key, partition = self.expiry.popleft()
            if self.table.get(key) is not None:
                acks.append(await self.table.write(key, None, partition))
        if acks:
            self.stats.add("done_expired", len(acks))
        return acks

    async def _abandon(self) -> list[Any]:
        """Dead-letter and delete the states idle past `abandon_after_s`; their ack futures."""
        now = time.time()
        horizon = now - self.config.abandon_after_s
        acks = []
        while self.assembling:
            key, (written, partition) = next(iter(self.assembling.items()))
            if written > horizon:
                break
            del self.assembling[key]
            state = self._load(key)
            if state is None or state.status != "assembling":
                continue
            final = state.final_index
            reason = (
                f"trajectory {key.decode()!r} (attempt {state.attempt_id!r}) abandoned with turns"
                f" {sorted(state.turns)}"
                + (f" of 0..{final}" if final is not None else " and no final turn")
                + f"; no new turn for {now - written:.0f} s"
                f" (abandon_after_s={self.config.abandon_after_s:g})"
            )
            for raw in state.turns.values():
                acks.append(
                    await self._send_letter(
                        abandoned_letter(self.turns_topic, partition, key, raw, reason)
                    )
                )
            acks.append(await self.table.write(key, None, partition))
            self.stats.add("abandoned")
        return acks

    def _load(self, key: bytes) -> TrajectoryState | None:
        raw = self.table.get(key)
        return TrajectoryState.from_bytes(raw) if raw else None

    async def process(self, records: list[ConsumerRecord]) -> Awaitable[None]:
        """Steps 1-3 of the module doc; the awaitable that settles the batch."""
        started = time.monotonic()
        acks: list[Any] = await self._expire()  # broker futures of everything sent
        acks += await self._abandon()
        if not records:  # an idle sweep (`sweep_interval_s`): no batch, no batch timings
            self.stats.add("sweeps")
            return self._acked(acks)
        self.stats.add("batches")
        self.stats.add("turns", len(records))
        self.metrics.consumed(self.turns_topic, len(records))
        decoded: list[tuple[ConsumerRecord, TurnEvent]] = []
        for n, record in enumerate(records, 1):
            if n % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the previous batch's acknowledgements in
            try:
                turn = decode_as(record.value, TurnEvent)
                if record.key is not None and record.key != turn.trajectory_id.encode():
                    # A mis-keyed turn sits in another partition than its trajectory.
                    raise DecodeError(
                        f"record key {record.key!r} is not the turn's trajectory id"
                        f" {turn.trajectory_id!r}",
                        cause="key_mismatch",
                    )
            except DecodeError as exc:
                self.stats.add("decode_errors")
                acks.append(await self._send_letter(record_letter(record, exc)))
                continue
            decoded.append((record, turn))

        states: dict[bytes, TrajectoryState | None] = {}
        first: dict[bytes, int] = {}  # key → partition of its turns
        fresh: dict[tuple[bytes, str, int], TurnEvent] = {}  # decoded in this batch
        dirty: set[bytes] = set()
        completed: dict[bytes, ConsumerRecord] = {}
        for record, turn in decoded:
            key = turn.trajectory_id.encode()
            fresh.setdefault((key, turn.attempt_id, turn.turn_index), turn)
            if key not in states:
                states[key] = self._load(key)
                first[key] = record.partition
            state, outcome = apply_turn(states[key], turn, record.value)
            states[key] = state
            self.stats.add(outcome)
            if outcome == "duplicate_uid":
                where = f"trajectory {turn.trajectory_id}"
                exc = DuplicateUidError(turn.uid, state.digest, turn.prompt_digest, where)
                acks.append(await self._send_letter(record_letter(record, exc)))
            if outcome in _CHANGES:
                dirty.add(key)
            if outcome == "complete":
                completed[key] = record
        mark = self.stats.timing("t_decode", started)

        done: list[tuple[bytes, str]] = []  # key, outcome: DONE once acknowledged
        recovered: list[bytes] = []  # emitted before a crash: DONE, not counted again
        drafts: list[tuple[bytes, ConsumerRecord, Assembled]] = []
        for key, record in completed.items():
            state = states[key]
            assert state is not None
            if key.decode() in self.recovered:
                self.stats.add("emit_recovered_present")
                recovered.append(key)
                continue
            try:
                known = {
                    i: fresh[key, state.attempt_id, i]
                    for i in state.turns
                    if (key, state.attempt_id, i) in fresh
                }
                drafts.append((key, record, assemble(state, known)))
            except DecodeError as exc:
                raw_final = state.turns[state.final_index or 0]
                acks.append(await self._send_letter(record_letter(record, exc, value=raw_final)))
                done.append((key, "dead_lettered"))
        await asyncio.sleep(0)
        results = await self.dispatcher.score_batch([d[2] for d in drafts])
        mark = self.stats.timing("t_score", mark)

        outputs: list[tuple[ScoredTrajectory, float | None]] = []  # and when turn 0 was made
        for (key, record, draft), result in zip(drafts, results, strict=True):
            scored, outcome = self._judge(draft, result)
            if outcome == "dead_lettered":
                assert isinstance(result, RewardError)
                acks.append(await self._send_letter(trajectory_letter(record, scored, result)))
            else:
                partition = self.ledger.partition_of(scored.uid)
                headers = [*headers_for(scored), (TRAJECTORY_ID, scored.trajectory_id.encode())]
                if outcome == "failure_scored":  # `rollout status` counts these by cause
                    cause = str(scored.reward_extra["reward_error_cause"])
                    headers.append((REWARD_FAILURE, cause.encode()))
                acks.append(
                    await self.producer.send(
                        self.scored_topic,
                        encode(scored),
                        key=scored.uid.encode(),
                        partition=partition,
                        headers=headers,
                    )
                )
                outputs.append((scored, draft.started_at))
            done.append((key, outcome))
        for _, outcome in done:
            self.stats.add(outcome)
        now = time.time()
        for key in dirty:
            state = states[key]
            assert state is not None
            if state.status == "assembling" and not state.complete:
                state.updated_at = now
                acks.append(await self.table.write(key, state.to_bytes(), first[key]))
                self.assembling.pop(key, None)  # to the end: the newest write
                self.assembling[key] = (now, first[key])
        finished: list[tuple[bytes, bytes, int]] = []
        for key, outcome in [*done, *((key, "scored") for key in recovered)]:
            state = states[key]
            assert state is not None
            state.mark_done(outcome, now)
            value = state.to_bytes()
            self.table.put(key, value, first[key])
            finished.append((key, value, first[key]))
        for key, state in states.items():
            if state is None or state.status != "assembling":
                self.assembling.pop(key, None)
        self.stats.timing("t_send", mark)
        self.stats.timing("t_batch", started)
        return self._settle(acks, finished, outputs, now)

    def _judge(self, draft: Assembled, result: Any) -> tuple[ScoredTrajectory, str]:
        """The trajectory with its score, and its outcome: scored, failure_scored, dead_lettered.

        A judge's answer without a verdict is failure-scored whatever `on_failure` says (the
        trajectory is sound; dropping it would lose it for the judge's fault), with the
        judge's `failure_score`, and counted."""
        judged = self.dispatcher.kind == "judge"
        if isinstance(result, Score):
            if judged:
                self.metrics.judge_verdict("parsed")
            value, extra = result.value, result.extra
            penalty = overlong_penalty(len(draft.fields["response_ids"]), self.config.overlong)
            if penalty:
                value, extra = value + penalty, {**extra, "overlong_penalty": penalty}
            return ScoredTrajectory(
                **draft.fields, reward_score=value, reward_extra=extra
            ), "scored"
        self.stats.add("scorer_timeouts" if isinstance(result, ScorerTimeout) else "scorer_errors")
        if isinstance(result, UnknownDataSource):
            self.stats.add("unknown_data_source")
        unparseable = isinstance(result, VerdictError)
        if unparseable:
            self.stats.add("unparseable_verdicts")
        if judged:
            self.metrics.judge_verdict("unparseable" if unparseable else "failed")
        tagged = ScoredTrajectory(
            **draft.fields,
            reward_score=self.config.judge.failure_score
            if unparseable
            else self.config.failure_score,
            reward_extra={
                "reward_failed": True,
                "reward_error_class": getattr(result, "error_class", type(result).__name__),
                "reward_error_cause": result.cause,
                "reward_error": str(result)[:1000],
            },
        )
        if unparseable or (
            self.config.on_failure == "score" and not isinstance(result, UnknownDataSource)
        ):
            return tagged, "failure_scored"
        return tagged, "dead_lettered"

    async def _acked(self, acks: list[Any]) -> None:
        if acks:
            await asyncio.gather(*acks)

    async def _settle(
        self,
        acks: list[Any],
        finished: list[tuple[bytes, bytes, int]],
        outputs: list[tuple[ScoredTrajectory, float | None]],
        finished_at: float,
    ) -> None:
        """Every acknowledgement; then the DONE states, persisted and acknowledged."""
        started = time.monotonic()
        if acks:
            await asyncio.gather(*acks)
        now = time.time()
        self.metrics.produced(self.scored_topic, len(outputs))
        for _, first_turn in outputs:
            if first_turn is not None:
                self.metrics.observe_trajectory(now - first_turn)
        writes = [
            await self.table.write(key, value, partition) for key, value, partition in finished
        ]
        if writes:
            await asyncio.gather(*writes)
        self.expiry.extend((finished_at, key, partition) for key, _, partition in finished)
        self.stats.timing("t_settle", started)

    async def _send_letter(self, letter: DeadLetter) -> Any:
        return await self.letters.send(letter)
