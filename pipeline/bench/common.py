"""What several benchmarks share: a broker to run against and the tiny model."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workers.kafka.config import KafkaConfig

__all__ = ["bench_broker", "tiny_model"]


@contextmanager
def bench_broker(kafka: KafkaConfig) -> Iterator[KafkaConfig]:
    """The configured cluster if the run names one (`--bootstrap`, `kafka.bootstrap_servers`
    in the config or ROLLOUT_KAFKA__BOOTSTRAP_SERVERS), else a local broker on a free port
    with a throw-away data directory, stopped afterwards."""
    if "bootstrap_servers" in kafka.model_fields_set:
        from workers.kafka.clients import make_admin

        make_admin(kafka).close()  # unreachable: one line now, not after the replicas started
        yield kafka
        return
    from pipeline.kafka_local import start_broker, stop_broker

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="rollout-bench-kafka-") as data:
        state = start_broker(port, Path(data), quiet=True)
        try:
            yield kafka.model_copy(update={"bootstrap_servers": [state.bootstrap]})
        finally:
            stop_broker(port)


@contextmanager
def tiny_model(model_dir: str | None = None) -> Iterator[str]:
    """`model_dir` if given, else the tiny model built into a temporary directory."""
    if model_dir:
        yield model_dir
        return
    from workers.llm.model_init import init_model

    with tempfile.TemporaryDirectory(prefix="rollout-bench-model-") as tmp:
        yield str(init_model(Path(tmp) / "tiny", preset="tiny", seed=0))
