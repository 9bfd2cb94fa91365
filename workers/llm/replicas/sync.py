"""The replica weight-sync controller: `rl.policy` → `POST /update_weights` on one replica.

    rollout replica sync --replica http://127.0.0.1:8100

or embedded beside a replica: `run_controller(kafka, topics, replica_url, stop_event)` in a
thread (it runs an event loop of its own). It reads the compacted policy topic from the
beginning without a consumer group (`workers.kafka.follow.TopicFollower`: every replica sees
every version), keeps the newest `PolicyVersion`, and whenever that is
newer than what the replica serves (its `/health` version) posts `{path, version}` to the
replica's `/update_weights`, which by the replica contract pauses (aborting in-flight
requests, which the LLM client resumes transparently), loads, sets the version and resumes.

Invariants:
- Idempotent: a version the replica already serves (or a newer one) is never posted again;
  intermediate versions that arrive while a load runs are skipped (the newest wins).
- The replica's version is re-read every `health_interval_s`: a replica that restarted at an
  older version is brought back to the newest one.
- A checkpoint the replica rejects (4xx: missing, pruned, wrong shapes) is logged and not
  retried for that version; connection errors and 5xx are retried with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from schemas.errors import RolloutError
from schemas.events import PolicyVersion
from workers.kafka.admin import topic_partitions
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.follow import TopicFollower
from workers.metrics import StageMetrics

__all__ = ["ReplicaSync", "SyncError", "run_controller"]

log = logging.getLogger("rollout.replica.sync")


class SyncError(RolloutError):
    """The policy topic cannot be followed (it does not exist)."""


class ReplicaSync:
    """The state of one controller: the newest version seen and what the replica serves."""

    def __init__(self, replica_url: str, *, request_timeout_s: float = 600.0) -> None:
        self.url = replica_url.rstrip("/")
        self.timeout = request_timeout_s
        self.newest: PolicyVersion | None = None
        self.served: int | None = None
        self.rejected: set[int] = set()
        self.applied: list[int] = []

    def observe(self, event: PolicyVersion) -> None:
        if self.newest is None or event.version > self.newest.version:
            self.newest = event

    def refresh(self) -> int | None:
        """Read the replica's version from `/health` (None if it does not answer).

        A replica whose last weight load failed answers 503 with the version it still serves
        (`vllm_adapter`): that version is read too, so the load stays due and is retried,
        instead of the replica being taken for one that is not answering."""
        try:
            body = self._request("GET", "/health", None)
        except urllib.error.HTTPError as exc:
            body = _json_body(exc)
            if exc.code != 503 or body.get("version") is None or body.get("reason") == "starting":
                return self._unreachable(exc)
            log.debug(
                "replica %s unhealthy (%s), serving version %s", self.url, body, body["version"]
            )
        except (OSError, ValueError) as exc:
            return self._unreachable(exc)
        self.served = int(body.get("version", 0))
        return self.served

    def _unreachable(self, exc: BaseException) -> None:
        # loud once when a known replica goes away, quiet while one is still starting
        level = logging.WARNING if self.served is not None else logging.DEBUG
        log.log(level, "replica %s /health failed: %s", self.url, exc)
        self.served = None

    def due(self) -> bool:
        new = self.newest
        return (
            new is not None
            and self.served is not None
            and new.version > self.served
            and new.version not in self.rejected
        )

    def apply(self) -> bool:
        """Post the newest version; True when the replica now serves it."""
        new = self.newest
        assert new is not None
        started = time.monotonic()
        try:
            self._request("POST", "/update_weights", {"path": new.path, "version": new.version})
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if 400 <= exc.code < 500:
                log.error(
                    "replica %s rejected version %d (%s): %s",
                    self.url,
                    new.version,
                    new.path,
                    detail,
                )
                self.rejected.add(new.version)
            else:
                log.warning(
                    "replica %s failed version %d: %s %s", self.url, new.version, exc.code, detail
                )
            return False
        except (OSError, ValueError) as exc:
            log.warning("replica %s unreachable for version %d: %s", self.url, new.version, exc)
            self.served = None
            return False
        self.served = new.version
        self.applied.append(new.version)
        log.info(
            "replica %s now serves version %d from %s (%.2fs)",
            self.url,
            new.version,
            new.path,
            time.monotonic() - started,
        )
        return True

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            parsed = json.loads(response.read() or b"{}")
        return parsed if isinstance(parsed, dict) else {}


def run_controller(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    replica_url: str,
    stop_event: threading.Event,
    *,
    poll_timeout_s: float = 1.0,
    health_interval_s: float = 5.0,
    request_timeout_s: float = 600.0,
    metrics: StageMetrics | None = None,
) -> ReplicaSync:
    """Keep `replica_url` on the newest policy version until `stop_event` is set.

    `metrics` (stage "sync") counts the policy records read and knows the newest version.
    """
    sync = ReplicaSync(replica_url, request_timeout_s=request_timeout_s)
    topic = topics.name("policy")
    metrics = metrics or StageMetrics("sync")
    metrics.watch(policy_version=lambda: sync.newest.version if sync.newest else 0)
    if topic_partitions(kafka, topic) is None:
        raise SyncError(f"topic {topic} does not exist (run `rollout topics create`)")
    asyncio.run(
        _control(kafka, topic, sync, stop_event, poll_timeout_s, health_interval_s, metrics)
    )
    return sync


async def _control(
    kafka: KafkaConfig,
    topic: str,
    sync: ReplicaSync,
    stop_event: threading.Event,
    poll_timeout_s: float,
    health_interval_s: float,
    metrics: StageMetrics,
) -> None:
    """Poll the policy topic and bring the replica to the newest version until `stop_event`
    (the replica's HTTP calls run in a thread: the consumer's loop keeps running)."""
    client_id = f"{kafka.client_id}-replica-sync"
    follower = TopicFollower(kafka, topic, client_id=client_id, metrics=metrics)
    await follower.start()
    try:
        last_health = 0.0
        backoff = 0.5
        log.info("syncing replica %s from %s", sync.url, follower.topic)
        while not stop_event.is_set():
            for event in await follower.poll(timeout_ms=int(poll_timeout_s * 1000)):
                if isinstance(event, PolicyVersion):
                    sync.observe(event)
            now = time.monotonic()
            if sync.served is None or now - last_health > health_interval_s:
                await asyncio.to_thread(sync.refresh)
                last_health = now
            if sync.due():
                if await asyncio.to_thread(sync.apply):
                    backoff = 0.5
                else:
                    await asyncio.to_thread(stop_event.wait, backoff)
                    backoff = min(backoff * 2, 30.0)
    finally:
        await follower.stop()


def _json_body(exc: urllib.error.HTTPError) -> dict[str, Any]:
    """The JSON object an HTTP error carries ({} when it carries none)."""
    try:
        parsed = json.loads(exc.read() or b"{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
