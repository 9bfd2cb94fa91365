"""`PromptProducer`: datasets or any iterable of rows → `rl.prompts`.

Produces with acks=all and the idempotent producer, keyed by uid, with the codec's headers.
Rows that are not valid prompts are reported with their row number (from 1) and skipped, and
so are rows the run's scorer could not score (`unscorable`: `RewardConfig.unscorable`, which
`rollout produce` passes unless `--allow-unscorable`), before any compute is spent on them.
A prompt's images (`image_url` parts, verl's `images` column) are read, size-checked and put
in the media store (`media`), and the event sent carries their references
(`schemas.media`); `close()` (or leaving the context manager) flushes, so every counted
prompt is acknowledged.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka.errors import KafkaError

from pipeline.data.datasets import (
    RowError,
    dataset_uid_prefix,
    read_rows,
    row_to_prompt,
    unused_columns,
)
from schemas.codec import encode, headers_for
from schemas.events import PromptEvent
from workers.kafka.clients import make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.exceptions import DeliveryError
from workers.media.config import MediaConfig
from workers.media.exceptions import MediaError
from workers.media.ingest import Ingestor

__all__ = ["ProduceReport", "PromptProducer"]

log = logging.getLogger("rollout.produce")


@dataclass
class ProduceReport:
    sent: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: column no stage reads → rows that had it (carried nowhere; named so it is not silent)
    unused_columns: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        rate = self.sent / self.seconds if self.seconds > 0 else 0.0
        text = f"produced {self.sent} prompts, skipped {self.skipped} invalid rows ({rate:.0f}/s)"
        if self.unused_columns:
            named = ", ".join(f"{c} ({n} rows)" for c, n in sorted(self.unused_columns.items()))
            text += f"; columns no stage reads, not sent: {named}"
        return text


class PromptProducer:
    """Produce `PromptEvent`s to the prompts topic."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig | None = None,
        media: MediaConfig | None = None,
        *,
        unscorable: Callable[[str, Any], str | None] | None = None,
    ) -> None:
        """`unscorable(data_source, ground_truth)`: why the run could not score such a prompt
        (None: it can); a row it names is skipped with that reason."""
        self._topics = topics or TopicsConfig()
        self._unscorable = unscorable
        self._ingest = Ingestor(media or MediaConfig())
        self.topic = self._topics.name("prompts")
        self._producer = make_producer(kafka, name="prompt-producer")
        self._failures: list[BaseException] = []

    def __enter__(self) -> PromptProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, event: PromptEvent) -> None:
        future = self._producer.send(
            self.topic, key=event.uid, value=encode(event), headers=headers_for(event)
        )
        future.add_errback(self._failures.append)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every prompt sent is acknowledged by the in-sync replicas (`None`: as
        long as that takes; each record is retried for `kafka.delivery_timeout_ms`, through a
        broker's loss and the election of its partitions' new leaders)."""
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise DeliveryError(f"prompts not acknowledged: {exc}") from exc
        if self._failures:
            first = self._failures[0]
            raise DeliveryError(f"{len(self._failures)} prompts failed to deliver: {first}")

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._producer.close()

    def produce_rows(
        self,
        rows: Iterable[Any],
        *,
        uid_prefix: str = "row",
        default_data_source: str | None = None,
        limit: int | None = None,
        rate: float | None = None,
        progress: bool = False,
    ) -> ProduceReport:
        """Produce rows (dicts, or `(row_number, row)` pairs from `read_rows`)."""
        report = ProduceReport()
        started = time.monotonic()
        bar = _progress(progress, limit)
        for index, item in enumerate(rows):
            if limit is not None and report.sent >= limit:
                break
            number, row = item if _is_numbered(item) else (index, item)
            try:
                event = (
                    _ingested(self._ingest, row, number)
                    if isinstance(row, PromptEvent)
                    else row_to_prompt(
                        row,
                        number,
                        uid_prefix=uid_prefix,
                        default_data_source=default_data_source,
                        ingest=self._ingest,
                    )
                )
                if self._unscorable is not None and (
                    why := self._unscorable(event.data_source, event.reward_model.ground_truth)
                ):
                    raise RowError(number, f"{why} (--allow-unscorable sends it anyway)")
            except RowError as exc:
                report.skipped += 1
                report.errors.append(str(exc))
                log.debug("skipping %s", exc)  # the report carries it; its reader shows it
                continue
            if not isinstance(row, PromptEvent):
                report.unused_columns.update(unused_columns(row))
            if rate:
                delay = started + report.sent / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            self.send(event)
            report.sent += 1
            if bar is not None:
                bar.update(1)
        self.flush()
        if bar is not None:
            bar.close()
        report.seconds = time.monotonic() - started
        return report

    def produce_file(self, path: str | Path, **kwargs: Any) -> ProduceReport:
        kwargs.setdefault("uid_prefix", dataset_uid_prefix(path))
        return self.produce_rows(read_rows(path), **kwargs)


def _ingested(ingest: Ingestor, event: PromptEvent, number: int) -> PromptEvent:
    try:
        return ingest(event)
    except MediaError as exc:
        raise RowError(number, str(exc)) from None


def _is_numbered(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)


def _progress(enabled: bool, total: int | None) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="prompt", file=sys.stderr, desc="produce")
