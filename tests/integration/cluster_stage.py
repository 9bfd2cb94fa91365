"""A minimal stage on the real `StageLoop`, run as its own process by the failover tests.

`python -m tests.integration.cluster_stage BOOTSTRAP INPUT OUTPUT GROUP`: every record of
INPUT becomes one record on OUTPUT (same key, value `"<partition>:<offset>"` of the input), sent
by the pipeline's idempotent acks=all aiokafka producer; a batch's offsets are committed only
once its outputs are acknowledged (the loop's rule, as in the reward and replay stages). No
de-duplication: an input processed twice shows as two outputs, which is what the tests count.
Exits 0 on SIGTERM after committing; 70 if the loop gives up on Kafka.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from workers.kafka.clients import make_aio_producer
from workers.kafka.config import KafkaConfig
from workers.kafka.stateful import StageLoop


async def main(bootstrap: str, source: str, output: str, group: str) -> int:
    kafka = KafkaConfig(bootstrap_servers=bootstrap)
    producer = make_aio_producer(kafka, client_id=f"copy-{group}")

    async def process(records: list[Any]) -> Any:
        futures = [
            await producer.send(
                output, key=r.key, value=f"{r.partition}:{r.offset}".encode(), partition=None
            )
            for r in records
        ]
        if not futures:
            return None
        return asyncio.gather(*futures)

    loop = StageLoop(
        kafka,
        stage="copy",
        group_id=group,
        topic=source,
        tables=[],
        process=process,
        batch_size=50,
        batch_within_s=0.05,
        commit_interval_s=0.3,
        session_timeout_s=10.0,
    )
    return await loop.serve(producer.start, producer.stop)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    sys.exit(asyncio.run(main(*sys.argv[1:5])))
