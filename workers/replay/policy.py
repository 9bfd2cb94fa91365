"""`PolicyTracker`: the latest policy version, read from the compacted `rl.policy` topic.

The tracker reads every partition of the topic from the beginning (`workers.kafka.follow`),
keeps the maximum `PolicyVersion.version` seen (0 before the trainer publishes anything), and
follows the topic in a background task. `start()` returns only after it has read up to the
end offsets it found, so the first group judged after a (re)start already sees the latest
published version.

Values that are not a `PolicyVersion` (and tombstones) are counted and logged, not
dead-lettered: every replay worker re-reads the whole topic on every start, so dead-lettering
would repeat the same letter again and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaProducer, TopicPartition

from schemas.events import PolicyVersion
from workers.kafka.config import KafkaConfig
from workers.kafka.follow import decoded, follower

__all__ = ["PolicyTracker"]

log = logging.getLogger("rollout.replay.policy")


class PolicyTracker:
    """The max policy version on the policy topic, kept current in the background."""

    def __init__(self, kafka: KafkaConfig, topic: str, *, client_id: str) -> None:
        self.topic = topic
        self.version = 0
        self.invalid = 0
        self._consumer = follower(kafka, client_id=client_id)
        self._task: asyncio.Task[None] | None = None

    async def start(self, producer: AIOKafkaProducer, catch_up_timeout_s: float = 60.0) -> None:
        """Read the topic to its end (its partitions learnt through `producer`'s metadata)."""
        parts = await producer.partitions_for(self.topic)
        if not parts:
            raise RuntimeError(f"policy topic {self.topic} does not exist")
        await self._consumer.start()
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        ends = await self._consumer.end_offsets(tps)
        deadline = asyncio.get_running_loop().time() + catch_up_timeout_s
        while [tp for tp in tps if await self._consumer.position(tp) < ends[tp]]:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"could not read {self.topic} to its end")
            await self._poll(timeout_ms=500)
        log.info("policy version %d (read %s to its end)", self.version, self.topic)
        self._task = asyncio.create_task(self._follow(), name="replay-policy-tracker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    async def _follow(self) -> None:
        while True:
            try:
                await self._poll(timeout_ms=1000)
            except asyncio.CancelledError:
                raise
            except Exception:
                # The consumer reconnects by itself; a stale version for a moment is harmless.
                log.warning("reading %s failed; retrying", self.topic, exc_info=True)
                await asyncio.sleep(1.0)

    async def _poll(self, timeout_ms: int) -> None:
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=1000)
        for records in batches.values():
            for record in records:
                event = decoded(record)  # logs what does not decode
                if not isinstance(event, PolicyVersion):
                    if event is not None:
                        log.warning("ignoring a %s on %s", type(event).__name__, self.topic)
                    self.invalid += 1
                    continue
                if event.version > self.version:
                    log.info("policy version %d → %d", self.version, event.version)
                    self.version = event.version
