"""The Kafka client libraries' own log records: shown only when the user asks (`--verbose`).

kafka-python and aiokafka log every refused connection, every retried `NotLeaderForPartition`
after a broker restart and every slow step of their event loop at WARNING or ERROR, ten lines
a second while a broker is away. The pipeline reports what matters itself, in one line
naming the cause (`KafkaUnavailableError`, a stage's exit status), so by default only their
CRITICAL records pass; with `-v` every record passes at its own level again.
"""

from __future__ import annotations

import logging

__all__ = ["CLIENT_LOGGERS", "route_client_logs"]

CLIENT_LOGGERS = ("kafka", "aiokafka")


def route_client_logs(verbose: int = 0) -> None:
    """Hide the client libraries' records unless `verbose` (the count of `-v` flags) is set."""
    level = logging.NOTSET if verbose > 0 else logging.CRITICAL
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(level)
