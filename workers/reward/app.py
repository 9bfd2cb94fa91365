"""The reward stage: `rl.turns` → one `ScoredTrajectory` per trajectory, on a `StageLoop`.

The loop (`workers.kafka.stateful`) consumes `rl.turns` as one consumer group in batches;
`batch.TurnProcessor` does the work of each (decode, assemble, score, produce) and hands
back what settles it, so the next batch is processed while the broker acknowledges this
one. The trajectories table (a `ChangelogTable` keyed by trajectory id) is written by the
stage's own producer, on the changelog partition of the source partition, and restored from
that topic on start and whenever the group's assignment changes.

Every offset commit carries the stage's recovery point (`ledger`): how far `rl.scored`
reached while none of the stage's outputs was unacknowledged. When partitions are
assigned, the stage reads `rl.scored` from the oldest recovery point among them (from its
beginning if one has none) and remembers which trajectories are there, so the turns that
come again after a crash do not emit them twice (`batch` has the rules).

Any failure to talk to Kafka ends the process at once (exit 70) without committing a
half-processed batch; restart it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from workers.kafka.changelog import ChangelogTable
from workers.kafka.clients import make_aio_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.stateful import StageLoop
from workers.metrics import StageMetrics
from workers.reward.batch import TurnProcessor
from workers.reward.config import RewardConfig
from workers.reward.dispatch import Dispatcher
from workers.reward.exceptions import RewardError
from workers.reward.ledger import (
    MAX_OUTPUT_PARTITIONS,
    ScoredLedger,
    format_recovery_point,
    parse_recovery_point,
)
from workers.reward.letters import STAGE
from workers.reward.pool import ScorerPool
from workers.reward.rm_client import RewardModelClient
from workers.reward.stats import RewardStats

__all__ = ["STAGE", "RewardStage"]

log = logging.getLogger("rollout.reward")


class RewardStage:
    """The stage's loop and table, and the clients its batches produce with."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        config: RewardConfig,
        *,
        tokenizer: object | None,
        metrics: StageMetrics | None = None,
    ) -> None:
        self.kafka = kafka
        self.topics = topics
        self.config = config
        self.turns_topic_name = topics.name("turns")
        self.scored_topic = topics.name("scored")
        self.dlq_topic = topics.name("dlq")
        self.tokenizer = tokenizer
        self.stats = RewardStats(config.stats_path)
        # Fed where `stats` counts; in flight = trajectories with turns seen, not yet finished.
        self.metrics = metrics or StageMetrics("reward")
        self.metrics.watch(
            in_flight=lambda: len(self.processor.assembling) if self.processor else 0
        )
        self.client_id = f"{kafka.client_id}-{config.group_id}"
        self.table = ChangelogTable(kafka, config.changelog_topic, client_id=self.client_id)
        self.loop = StageLoop(
            kafka,
            stage="reward",
            topic=self.turns_topic_name,
            tables=[self.table],
            process=self.process,
            on_assigned=self._on_assigned,
            commit_metadata=self._recovery_point,
            **config.loop_settings(),
        )
        self.producer: AIOKafkaProducer | None = None
        self.ledger: ScoredLedger | None = None
        self.pool: ScorerPool | None = None
        self.dispatcher: Dispatcher | None = None
        self.processor: TurnProcessor | None = None

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
        """Producer, ledger, scorer pool, reward-model client or judge (before the group
        join)."""
        client_id = self.client_id
        self.producer = make_aio_producer(self.kafka, client_id=f"{client_id}-out")
        await self.producer.start()
        self.table.producer = self.producer
        self.ledger = ScoredLedger(self.kafka, self.scored_topic, client_id=f"{client_id}-ledger")
        await self.ledger.start(self.producer)
        if self.ledger.partition_count > MAX_OUTPUT_PARTITIONS:
            raise RewardError(
                f"{self.scored_topic} has {self.ledger.partition_count} partitions; "
                f"the reward stage's recovery point (offset commit metadata) holds at most "
                f"{MAX_OUTPUT_PARTITIONS}"
            )
        if self._needs_pool():
            self.pool = ScorerPool(self.config.pool_workers)
            await self.pool.start()
        rm = self.config.reward_model
        client = None
        if rm.enable and rm.style == "discriminative" and self.config.custom is None:
            client = RewardModelClient(rm.addresses, timeout_s=rm.timeout_s, max_batch=rm.max_batch)
        judge = None
        if self.config.scorer_kind == "judge":
            from workers.reward.judge import Judge  # the LLM client: only when there is a judge

            judge = Judge(
                self.config.judge, kafka=self.kafka, topics=self.topics, client_id=client_id
            )
            await judge.start()
        self.dispatcher = Dispatcher(
            self.config, tokenizer=self.tokenizer, pool=self.pool, reward_model=client, judge=judge
        )
        self.processor = TurnProcessor(
            self.config,
            self.table,
            producer=self.producer,
            ledger=self.ledger,
            dispatcher=self.dispatcher,
            stats=self.stats,
            metrics=self.metrics,
            topics=(self.turns_topic_name, self.scored_topic, self.dlq_topic),
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

    # --- recovery point ----------------------------------------------------------------

    async def _recovery_point(self) -> str:
        """Commit metadata: `rl.scored`'s end offsets (the loop asks with nothing unsettled)."""
        assert self.ledger is not None
        return format_recovery_point(await self.ledger.topic_end_offsets())

    async def _on_assigned(self, assigned: frozenset[int]) -> None:
        """Learn which trajectories reached `rl.scored` since the partitions' recovery points."""
        assert self.processor is not None and self.ledger is not None
        processor = self.processor
        processor.reindex()  # the table now holds the assigned partitions' states only
        processor.recovered = set()
        if not assigned:
            return
        starts: dict[int, int] | None = {}
        for partition in sorted(assigned):
            point = parse_recovery_point(self.loop.committed[partition].metadata)
            if point is None or len(point) != self.ledger.partition_count:
                starts = None  # never committed by this stage (or another layout): from the start
                break
            for out, offset in point.items():
                starts[out] = min(offset, starts.get(out, offset))
        if starts is None:
            starts = await self.ledger.topic_beginning_offsets()
        for out, offset in sorted(starts.items()):
            processor.recovered |= await self.ledger.emitted_since(out, offset)
        if processor.recovered:
            log.info(
                "recovery: %d trajectories already on %s since the last commits",
                len(processor.recovered),
                self.scored_topic,
            )

    # --- one batch -------------------------------------------------------------------

    async def process(self, records: list[ConsumerRecord]) -> Awaitable[None]:
        """One batch (see `batch`); what settles it."""
        assert self.processor is not None
        started = time.monotonic()
        settle = await self.processor.process(records)
        if records:  # not an idle sweep
            self.stats.last_batch_s = time.monotonic() - started
        extra = self.pool.stats() if self.pool is not None else None
        self.stats.write(extra)
        self.stats.warn_growth(
            ("after_done", "duplicate_completion"),
            "%d turns dropped as already scored (after_done, duplicate_completion): a turn "
            "redelivered after a restart, or a prompt produced again under a uid this stage "
            f"(group {self.config.group_id}) scored before; nothing is scored twice",
            log,
        )
        self.stats.log_every(log, "reward")
        return settle
