"""`PolicyTracker`: the latest policy version, read from the compacted `rl.policy` topic.

The tracker reads every partition of the topic from the beginning (a `TopicFollower` of
`workers.kafka.follow`), keeps the maximum `PolicyVersion.version` seen (0 before the trainer
publishes anything), and follows the topic in a background task. `start()` returns only after
it has read up to the end offsets it found, so the first group judged after a (re)start
already sees the latest published version.

Values that are not a `PolicyVersion` (and tombstones) are counted and logged, not
dead-lettered: every replay worker re-reads the whole topic on every start, so dead-lettering
would repeat the same letter again and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiokafka import AIOKafkaProducer

from schemas.events import PolicyVersion
from workers.kafka.config import KafkaConfig
from workers.kafka.follow import TopicFollower

__all__ = ["PolicyTracker"]

log = logging.getLogger("rollout.replay.policy")


class PolicyTracker:
    """The max policy version on the policy topic, kept current in the background."""

    def __init__(self, kafka: KafkaConfig, topic: str, *, client_id: str) -> None:
        self.topic = topic
        self.version = 0
        self._other = 0  # events of another kind
        self._follower = TopicFollower(kafka, topic, client_id=client_id)
        self._task: asyncio.Task[None] | None = None

    @property
    def invalid(self) -> int:
        """Records that were not a `PolicyVersion` (undecodable ones and tombstones too)."""
        return self._follower.skipped + self._other

    async def start(self, producer: AIOKafkaProducer, catch_up_timeout_s: float = 60.0) -> None:
        """Read the topic to its end (its partitions learnt through `producer`'s metadata)."""
        parts = await producer.partitions_for(self.topic)
        if not parts:
            raise RuntimeError(f"policy topic {self.topic} does not exist")
        await self._follower.start(parts)
        self._observe(await self._follower.read_to_end(catch_up_timeout_s))
        log.info("policy version %d (read %s to its end)", self.version, self.topic)
        self._task = asyncio.create_task(self._follow(), name="replay-policy-tracker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._follower.stop()

    async def _follow(self) -> None:
        while True:
            try:
                self._observe(await self._follower.poll(timeout_ms=1000))
            except asyncio.CancelledError:
                raise
            except Exception:
                # The consumer reconnects by itself; a stale version for a moment is harmless.
                log.warning("reading %s failed; retrying", self.topic, exc_info=True)
                await asyncio.sleep(1.0)

    def _observe(self, events: list[Any]) -> None:
        for event in events:
            if not isinstance(event, PolicyVersion):
                log.warning("ignoring a %s on %s", type(event).__name__, self.topic)
                self._other += 1
            elif event.version > self.version:
                log.info("policy version %d → %d", self.version, event.version)
                self.version = event.version
