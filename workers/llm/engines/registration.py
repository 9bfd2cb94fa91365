"""A replica's presence on the compacted replicas topic.

On start the replica registers a `ReplicaInfo` (id, address, backend, version) keyed by its
id, once its `/health` answers, however long that takes while the replica runs: its engine's
own start timeout bounds the start (vLLM's is 1,200 s; a replica that gives up exits, and the
registration with it), and a replica that waits for the trainer's first broadcast weights
answers 503 until they came, which has no bound here (a registration deadline shorter than
these left a healthy replica unrouted for ever). A line is logged every `NOTE_EVERY_S` while
it waits. On a clean stop it leaves a tombstone (null value, same key),
so log compaction forgets it and every router drops it. A replica that dies without a
tombstone stays listed until routers' health checks drop it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request

from kafka.errors import KafkaError

from schemas.codec import encode, headers_for
from schemas.errors import RolloutError
from schemas.events import ReplicaInfo
from workers.kafka.clients import ack_wait_s, make_producer
from workers.kafka.config import KafkaConfig

__all__ = ["NOTE_EVERY_S", "ReplicaRegistration"]

log = logging.getLogger("rollout.llm.registration")

NOTE_EVERY_S = 60.0  # while not yet healthy, a line this often


class ReplicaRegistration:
    """Register when healthy (in a background thread); tombstone on `leave()`."""

    def __init__(self, kafka: KafkaConfig, topic: str, info: ReplicaInfo) -> None:
        self.kafka = kafka
        self.topic = topic
        self.info = info
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float | None = None) -> None:
        """Register in the background once healthy; `timeout_s`: give up after it (None:
        wait as long as the replica runs, the default, see the module docstring)."""
        self._thread = threading.Thread(target=self._register, args=(timeout_s,), daemon=True)
        self._thread.start()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.info.address}/health", timeout=2) as resp:
                body = json.loads(resp.read() or b"{}")
                self.info = self.info.model_copy(
                    update={"version": int(body.get("version", self.info.version))}
                )
                return resp.status == 200
        except (OSError, ValueError):
            return False

    def _register(self, timeout_s: float | None) -> None:
        began = time.monotonic()
        deadline = None if timeout_s is None else began + timeout_s
        noted = began
        while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
            if time.monotonic() - noted >= NOTE_EVERY_S:
                noted = time.monotonic()
                log.warning("replica %s not healthy yet after %.0fs; registering once it is",
                            self.info.replica_id, noted - began)  # fmt: skip
            if self._healthy():
                try:
                    self.publish(self.info)
                except (KafkaError, RolloutError) as exc:
                    # The replica serves on; only routers that discover replicas miss it.
                    log.error(
                        "replica %s not registered on %s: %s", self.info.replica_id, self.topic, exc
                    )
                    return
                self.registered.set()
                log.info(
                    "registered replica %s at %s on %s",
                    self.info.replica_id,
                    self.info.address,
                    self.topic,
                )
                return
            self._stop.wait(0.5)
        if not self._stop.is_set():
            log.error("replica %s not healthy within %.0fs; not registered",
                      self.info.replica_id, timeout_s or 0.0)  # fmt: skip

    def publish(self, info: ReplicaInfo) -> None:
        producer = make_producer(self.kafka, name=f"replica-{info.replica_id}")
        try:
            producer.send(
                self.topic, key=info.replica_id, value=encode(info), headers=headers_for(info)
            ).get(timeout=ack_wait_s(self.kafka))
        finally:
            producer.close()

    def leave(self) -> None:
        self._stop.set()
        if not self.registered.is_set():
            return
        producer = make_producer(self.kafka, name=f"replica-{self.info.replica_id}")
        try:
            producer.send(self.topic, key=self.info.replica_id, value=None).get(
                timeout=ack_wait_s(self.kafka)
            )
            log.info("replica %s left (tombstone on %s)", self.info.replica_id, self.topic)
        finally:
            producer.close()
