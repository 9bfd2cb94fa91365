"""`GroupLedger`: where a group's output lands on `rl.replay`/`rl.stale`, and whether it did.

Every group is produced with key = uid to partition `murmur2(uid) % partitions` of its
destination topic (`workers.kafka.ledger`). Before producing, the stage records that
partition's end offset in the group's EMITTING marker; after a crash,
`emitted_since(topic, partition, offset, uids)` reads that partition from the recorded offset
to its end and returns which of the uids are there. A uid is produced by this stage at most
once per topic, so its key there means "emitted".
"""

from __future__ import annotations

from workers.kafka.ledger import OutputLedger

__all__ = ["GroupLedger"]


class GroupLedger(OutputLedger):
    """The replay stage's output ledger: groups found by key."""

    async def emitted_since(
        self, topic: str, partition: int, offset: int, uids: set[str]
    ) -> set[str]:
        """Which of `uids` appear as keys on `topic[partition]` from `offset` to its end."""
        wanted = {u.encode(): u for u in uids}
        return await self.scan(topic, partition, offset, lambda r: wanted.get(r.key))
