"""One batch of the replay stage: samples in, groups judged, persisted and produced.

`GroupProcessor.process(records)` takes one batch of `rl.scored` records (possibly none) and:

1. decodes each sample (undecodable, wrong kind or key ≠ uid → `rl.dlq`) and adds it to its
   group (`state` has the table layout); a sample index already in the group is a duplicate,
   a new one arriving after its group was finished is counted as late, and a sample of
   another prompt under the group's uid (its `prompt_digest` differs) goes to `rl.dlq` with
   cause `duplicate_uid`;
2. sweeps the open groups of the owned partitions: EMITTING ones (left by a crash) are looked
   up on their output partition (`ledger`): found → DONE, missing → judged again; complete
   ones, and those past `group_timeout_s` since their first sample, are judged
   (`groups.judge`: partial policy, staleness against the latest `rl.policy` version, zero
   variance, advantages);
3. persists new samples, then changed headers and an EMITTING marker per judged group (holding
   its output partition's end offset), and awaits the broker's acknowledgements;
4. produces each group to `rl.replay`, or to `rl.stale` with header `rl.stale.reason`
   (`schemas.stale`: `stale`, `zero_variance`, `timeout`: every finished prompt lands on one
   of the two, so the trainer's admission accounting can count dropped prompts too), and dead
   letters to `rl.dlq`, and awaits every acknowledgement;
5. deletes the finished groups' samples and marks them DONE (changelog writes, not awaited:
   a lost one leaves EMITTING, which step 2 resolves).

It returns only when everything the batch caused is acknowledged; any Kafka error propagates
(the loop then exits without committing). Only the groups of partitions this worker owns are
in `open` (`reindex` after every rebalance).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer

from schemas.codec import decode_as, encode, headers_for
from schemas.errors import DecodeError, DuplicateUidError
from schemas.events import ScoredTrajectory
from schemas.headers import STALENESS
from schemas.stale import drop_headers
from workers.kafka.dlq import AioDeadLetters
from workers.metrics import StageMetrics
from workers.replay.config import ReplayConfig
from workers.replay.groups import Decision, PendingGroup, judge
from workers.replay.ledger import GroupLedger
from workers.replay.policy import PolicyTracker
from workers.replay.state import GroupState
from workers.replay.stats import ReplayStats
from workers.replay.table import GroupTable

__all__ = ["STAGE", "GroupProcessor", "Routes"]

log = logging.getLogger("rollout.replay")

STAGE = "replay"

#: The group rules of `judge` that `ReplayConfig` holds, under the same names.
_JUDGE_SETTINGS = frozenset(inspect.signature(judge).parameters).intersection(
    ReplayConfig.model_fields
)


@dataclass(frozen=True)
class Routes:
    """The topics one batch reads from and writes to."""

    replay: str
    stale: str
    dlq: str


class GroupProcessor:
    """The per-batch logic of the stage, over the table and the stage's Kafka clients."""

    def __init__(
        self,
        config: ReplayConfig,
        table: GroupTable,
        stats: ReplayStats,
        routes: Routes,
        *,
        producer: AIOKafkaProducer,
        ledger: GroupLedger,
        policy: PolicyTracker,
        metrics: StageMetrics | None = None,
    ) -> None:
        self.config, self.table, self.stats, self.topics = config, table, stats, routes
        self.producer, self.ledger, self.policy = producer, ledger, policy
        self.metrics = metrics or StageMetrics("replay")
        self.letters = AioDeadLetters(producer, routes.dlq, stage=STAGE, metrics=self.metrics)
        self._open: dict[str, GroupState] = {}  # uid → unfinished group of an owned partition

    @property
    def open_groups(self) -> int:
        """Groups of owned partitions waiting for samples (or for their output's ack)."""
        return len(self._open)

    def reindex(self, assigned: frozenset[int]) -> None:
        """After a rebalance (and the table's recovery): the unfinished groups we own now."""
        self._open = self.table.open_groups(assigned)
        log.info("partitions %s: %d open groups", sorted(assigned), len(self._open))

    async def process(self, records: list[Any]) -> None:
        """Group, judge, persist and emit one batch (steps 1–5 of the module doc)."""
        now = time.time()
        pending: list[Any] = []  # broker futures of phase 2 (outputs and dead letters)
        fresh: dict[str, dict[int, bytes]] = {}  # uid → sample index → bytes, new this batch
        changed: dict[str, GroupState] = {}  # headers to persist in phase 1
        if not records:
            self.stats.add("ticks")
        self.stats.add("samples", len(records))
        if records:
            self.metrics.consumed(records[0].topic, len(records))
        for message in records:
            try:
                sample = decode_as(message.value, ScoredTrajectory)
                if message.key != sample.uid.encode():
                    raise DecodeError(
                        f"key {message.key!r} is not the sample's uid {sample.uid!r}",
                        cause="key_mismatch",
                    )
            except DecodeError as exc:
                self.stats.add("decode_errors")
                pending.append(await self._dead_letter(message, exc))
                continue
            clash = self._add(sample, message.value, message.partition, now, fresh, changed)
            if clash is not None:
                self.stats.add("duplicate_uid")
                pending.append(await self._dead_letter(message, clash))

        finish = [
            s
            for s in self._open.values()
            if s.status == "pending"
            and (s.complete or now - s.first_seen >= self.config.group_timeout_s)
        ]
        settled = await self._resolve_emitting(finish)
        outputs, unreadable = await self._judge_all(finish, fresh, changed)

        # Phase 1: new samples, then headers and EMITTING markers, acknowledged before outputs.
        writes = [
            self.table.put_sample(uid, i, raw, changed[uid].partition)
            for uid, by_index in fresh.items()
            for i, raw in by_index.items()
        ]
        writes += [self.table.put_group(state) for state in changed.values()]
        if writes:
            await asyncio.gather(*await asyncio.gather(*writes))

        # Phase 2: outputs and dead letters, every acknowledgement awaited.
        for state, decision, topic in outputs:
            pending.append(await self._produce(state, decision, topic))
        if pending:
            await asyncio.gather(*pending)

        # Phase 3: delete the samples, then DONE (a lost write leaves EMITTING, which resolves).
        done = [*settled, *unreadable, *(state for state, _, _ in outputs)]
        background = []
        for state in done:
            background += self.table.delete_samples(state)
            state.mark_done()
            background.append(self.table.put_group(state))
            self._open.pop(state.uid, None)
        for write in background:
            await write
        self.stats.add("batches")

    def _add(
        self,
        sample: ScoredTrajectory,
        raw: bytes,
        partition: int,
        now: float,
        fresh: dict[str, dict[int, bytes]],
        changed: dict[str, GroupState],
    ) -> DuplicateUidError | None:
        """Add one sample to its group; a sample of another prompt under the group's uid is
        returned as the error to dead-letter it with, and changes nothing."""
        uid, index = sample.uid, sample.sample_index
        state = self._open.get(uid) or self.table.load(uid)
        if state is None:
            # The prompt's own n travels with its samples; config n for producers that omit it.
            expected = sample.group_size or self.config.n
            state = GroupState(uid=uid, partition=partition, first_seen=now, expected=expected)
        given = sample.prompt_digest
        if state.digest is not None and given is not None and given != state.digest:
            return DuplicateUidError(uid, state.digest, given, f"group {uid} ({state.status})")
        if state.unfinished:
            self._open[uid] = state
        if state.digest is None and given is not None:
            state.digest = given
            changed[uid] = state
        if index in state.indices:
            self.stats.add("duplicates")
            return None
        if state.status != "pending":
            self.stats.add("late_samples")
            log.warning(
                "late sample %s: its group is already %s", sample.trajectory_id, state.status
            )
            return None
        if index >= state.expected:
            self.stats.add("beyond_n")
        if partition != state.partition:
            self.stats.add("partition_mismatch")
        state.indices.append(index)
        fresh.setdefault(uid, {})[index] = bytes(raw)
        changed[uid] = state
        return None

    async def _resolve_emitting(self, finish: list[GroupState]) -> list[GroupState]:
        """EMITTING groups (left by a crash): DONE if their output is there, else judged again."""
        marked = [s for s in self._open.values() if s.status == "emitting"]
        if not marked:
            return []
        wanted: dict[tuple[str, int], list[GroupState]] = {}
        for state in marked:
            topic = self.topics.replay if state.verdict == "replay" else self.topics.stale
            wanted.setdefault((topic, state.out_partition or 0), []).append(state)
        found: set[str] = set()
        for (topic, partition), states in wanted.items():
            since = min(s.since or 0 for s in states)
            found |= await self.ledger.emitted_since(
                topic, partition, since, {s.uid for s in states}
            )
        settled = []
        for state in marked:
            if state.uid in found:
                self.stats.add("emit_recovered_present")
                settled.append(state)
            else:
                self.stats.add("emit_recovered_missing")
                state.reopen()
                finish.append(state)
        return settled

    async def _judge_all(
        self,
        finish: list[GroupState],
        fresh: dict[str, dict[int, bytes]],
        changed: dict[str, GroupState],
    ) -> tuple[list[tuple[GroupState, Decision, str]], list[GroupState]]:
        """Judge every finished group; mark each EMITTING with its output's partition and offset.

        Returns the groups to produce, and the (never expected) groups with nothing to produce.
        """
        unreadable: list[GroupState] = []
        version = self.stats.policy_version = self.policy.version
        # Read as attributes: `max_staleness` is derived by the run and left out of dumps.
        rules = {name: getattr(self.config, name) for name in _JUDGE_SETTINGS}
        judged: list[tuple[GroupState, Decision, str, int]] = []
        for state in finish:
            samples = self._samples(state, fresh.get(state.uid, {}))
            if not samples:  # only if the table's bytes stopped decoding (a schema change)
                log.error("group %s has no readable samples; marking it done", state.uid)
                self.stats.add("groups_unreadable")
                state.verdict = "unreadable"
                unreadable.append(state)
                continue
            group = PendingGroup(state.uid, state.expected, state.first_seen, samples)
            decision = judge(group, current_version=version, **rules)
            self.stats.add("groups_complete" if group.complete else "groups_partial")
            self.stats.observe_staleness(decision.staleness)
            self.metrics.observe_staleness(decision.staleness)
            topic = self.topics.replay if decision.drop is None else self.topics.stale
            judged.append((state, decision, topic, self.ledger.partition_for(topic, state.uid)))
        ends = await self.ledger.end_offsets({(t, p) for _, _, t, p in judged}) if judged else {}
        for state, decision, topic, partition in judged:
            state.mark_emitting(decision.drop or "replay", partition, ends[topic, partition])
        for state in finish:
            changed[state.uid] = state
        return [(s, d, t) for s, d, t, _ in judged], unreadable

    def _samples(self, state: GroupState, fresh: dict[int, bytes]) -> dict[int, ScoredTrajectory]:
        out: dict[int, ScoredTrajectory] = {}
        for index in state.indices:
            raw = fresh.get(index) or self.table.sample(state.uid, index)
            try:
                out[index] = decode_as(raw, ScoredTrajectory)
            except DecodeError as exc:
                log.error("sample %s/%d of the table is unreadable: %s", state.uid, index, exc)
        return out

    async def _produce(self, state: GroupState, decision: Decision, topic: str) -> Any:
        assert decision.group is not None
        group = decision.group
        if decision.drop is not None:
            headers = drop_headers(headers_for(group), decision.drop, decision.staleness)
            self.stats.add(f"dropped_{decision.drop}")
        else:
            headers = [*headers_for(group), (STALENESS, str(decision.staleness).encode())]
            self.stats.add("emitted")
        self.metrics.produced(topic)
        return await self.producer.send(
            topic,
            encode(group),
            key=state.uid.encode(),
            partition=state.out_partition,
            headers=headers,
        )

    async def _dead_letter(self, message: Any, exc: DecodeError | DuplicateUidError) -> Any:
        return await self.letters.send_record(message, exc, cause=exc.cause)
