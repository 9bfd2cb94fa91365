"""The replay-buffer stage: `rl.scored` → one `TrainingGroup` per prompt, on a `StageLoop`.

The loop (`workers.kafka.stateful`) consumes `rl.scored` as one consumer group, in batches;
`batch.GroupProcessor` does the work of each batch and returns only when everything it
caused is acknowledged, and only then are the batch's offsets committed (at-least-once on
the input). When no sample arrives for `sweep_interval_s`, the loop calls the processor with
an empty batch, so groups past `group_timeout_s` expire without traffic. The groups of the
owned partitions live in a `ChangelogTable` (`table`), restored from its compacted
changelog on start and whenever the group's assignment changes.

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

import logging
import time

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from workers.kafka.changelog import ChangelogTable
from workers.kafka.clients import make_aio_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.stateful import StageLoop
from workers.metrics import StageMetrics
from workers.replay.batch import GroupProcessor, Routes
from workers.replay.config import ReplayConfig
from workers.replay.ledger import GroupLedger
from workers.replay.policy import PolicyTracker
from workers.replay.stats import ReplayStats
from workers.replay.table import GroupTable

__all__ = ["ReplayStage"]

log = logging.getLogger("rollout.replay")


class ReplayStage:
    """The stage's loop and table, and the clients its batches produce with."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        config: ReplayConfig,
        *,
        metrics: StageMetrics | None = None,
    ) -> None:
        self.kafka = kafka
        self.config = config
        self.scored_topic = topics.name("scored")
        self.replay_topic = topics.name("replay")
        self.stale_topic = topics.name("stale")
        self.policy_topic = topics.name("policy")
        self.dlq_topic = topics.name("dlq")
        self.stats = ReplayStats(config.stats_path)
        self.metrics = metrics or StageMetrics("replay")
        self.client_id = f"{kafka.client_id}-{config.group_id}"
        store = ChangelogTable(kafka, config.changelog_topic, client_id=self.client_id)
        self.table = GroupTable(store)
        self.loop = StageLoop(
            kafka,
            stage="replay",
            topic=self.scored_topic,
            tables=[store],
            process=self.process,
            on_assigned=self._on_assigned,
            **config.loop_settings(),
        )
        self.producer: AIOKafkaProducer | None = None
        self.ledger: GroupLedger | None = None
        self.policy: PolicyTracker | None = None
        self.processor: GroupProcessor | None = None
        self.metrics.watch(
            in_flight=lambda: self.processor.open_groups if self.processor else 0,
            policy_version=lambda: self.policy.version if self.policy else 0,
        )

    # --- lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        """Start the clients, run the loop until SIGTERM/SIGINT; the exit status."""
        status = await self.loop.serve(self.start_clients, self.close)
        log.info("replay stage stopped (%d): %s", status, self.stats.snapshot())
        return status

    async def start_clients(self) -> None:
        """Producer, output ledger and policy tracker (before the loop joins the group)."""
        self.producer = make_aio_producer(self.kafka, client_id=f"{self.client_id}-out")
        await self.producer.start()
        self.table.producer = self.producer
        self.ledger = GroupLedger(
            self.kafka, [self.replay_topic, self.stale_topic], client_id=f"{self.client_id}-ledger"
        )
        await self.ledger.start(self.producer)
        self.policy = PolicyTracker(
            self.kafka, self.policy_topic, client_id=f"{self.client_id}-policy"
        )
        await self.policy.start(self.producer)
        routes = Routes(replay=self.replay_topic, stale=self.stale_topic, dlq=self.dlq_topic)
        self.processor = GroupProcessor(
            self.config,
            self.table,
            self.stats,
            routes,
            producer=self.producer,
            ledger=self.ledger,
            policy=self.policy,
            metrics=self.metrics,
        )
        log.info("replay stage ready: n=%d, policy version %d", self.config.n, self.policy.version)

    async def close(self) -> None:
        for client in (self.policy, self.ledger, self.producer):
            if client is not None:
                await client.stop()

    def _on_assigned(self, assigned: frozenset[int]) -> None:
        assert self.processor is not None
        self.processor.reindex(assigned)

    # --- one batch -------------------------------------------------------------------

    async def process(self, records: list[ConsumerRecord]) -> None:
        """One batch (see `batch`): an empty one only expires groups."""
        started = time.monotonic()
        assert self.processor is not None
        await self.processor.process(records)
        self.stats.last_batch_s = time.monotonic() - started
        self.stats.write()
        self.stats.warn_growth(
            ("duplicates", "late_samples"),
            "%d samples dropped as already grouped (duplicates, late_samples): redelivered "
            "after a restart, or produced again under a uid this stage (group "
            f"{self.config.group_id}) grouped before; no group is emitted twice",
            log,
        )
        self.stats.log_every(log, "replay")
