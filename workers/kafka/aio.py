"""The aiokafka producer every asyncio stage writes with, configured the pipeline's way.

Idempotent with `acks=all` (an output counts only once every in-sync replica has it),
`linger_ms=5`, and 1 MiB batches: aiokafka's 16 KiB default puts each trajectory or turn
(10+ KB) in a batch of its own and crawls. Records as large as `max_request_size`.
Connection and security settings come from `KafkaConfig`. The caller starts and stops it.
"""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from workers.kafka.config import KafkaConfig

__all__ = ["BATCH_BYTES", "make_aio_producer"]

BATCH_BYTES = 1024 * 1024


def make_aio_producer(kafka: KafkaConfig, *, client_id: str) -> AIOKafkaProducer:
    """An idempotent, acks=all aiokafka producer with 1 MiB batches (not started)."""
    return AIOKafkaProducer(
        **kafka.aiokafka_kwargs(),
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        linger_ms=5,
        max_batch_size=BATCH_BYTES,
        max_request_size=kafka.max_request_size,
    )
