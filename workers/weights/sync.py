"""The replica weight-sync controller: `rl.policy` → `POST /update_weights` on one replica.

    rollout replica sync --replica http://127.0.0.1:8100

or embedded beside a replica: `run_controller(kafka, topics, replica_url, stop_event)` in a
thread (it runs an event loop of its own). It reads the compacted policy topic from the
beginning without a consumer group (`workers.kafka.follow.TopicFollower`: every replica sees
every version), keeps the newest `PolicyVersion`, and whenever that is
newer than what the replica serves (its `/health` version) posts `{path, version}` to the
replica's `/update_weights`, which by the replica contract pauses (aborting in-flight
requests, which the LLM client resumes transparently), loads, sets the version and resumes.

With `weights.mode: broadcast` the newest `PolicyVersion` carries the trainer's
rendezvous (`transfer`): the controller keeps one want standing at the trainer's store
(`GrantClient`, below) and posts each grant that answers it to the replica
(`{version, transfer}`); the replica receives over the trainer's group, loads, and answers.
A replica that waits for its first weights (`awaiting_weights` in its 503 `/health`) first
tries the announced checkpoint when one is named and it can read it, else waits for a grant.
The want says what the replica's `/health` says: the dtype it serves (its weights travel in
it) and the groups it can receive over (`transfer_backends`; the trainer grants NCCL only to
a replica that names it). The checkpoint way is also taken, at the next version that names a
checkpoint this host can read, by a replica whose last grant failed (the trainer, which did
not see it join, writes a checkpoint at its next version and grants it nothing until then) and
by one that takes no broadcast at all (`transfer_backends` empty: SGLang), which never wants.

Invariants:
- Only a policy replica is synced: a replica whose `/health` says another role (a judge,
  serving another model) stops the controller with `SyncError` before anything is posted.
- Idempotent: a version the replica already serves (or a newer one) is never posted again;
  intermediate versions that arrive while a load runs are skipped (the newest wins). Under
  broadcast the newest is the latest record of a trainer session (a trainer restarted from an
  older checkpoint announces a new session, and its version wins even when lower).
- The replica's version is re-read every `health_interval_s`: a replica that restarted at an
  older version is brought back to the newest one.
- A checkpoint the replica rejects (4xx: missing, pruned, wrong shapes) is logged and not
  retried for that version; connection errors and 5xx are retried with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import timedelta
from typing import Any

from schemas.errors import RolloutError
from schemas.events import PolicyVersion, WeightTransfer
from workers.kafka.admin import topic_partitions
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.kafka.follow import TopicFollower
from workers.metrics import StageMetrics
from workers.weights.protocol import MEMBERS, Grant, Want, grant_key, want_key

__all__ = ["GrantClient", "ReplicaSync", "SyncError", "quiet_store_warnings", "run_controller"]

log = logging.getLogger("rollout.replica.sync")

CONNECT_TIMEOUT_S = 10.0


class SyncError(RolloutError):
    """The policy topic cannot be followed (it does not exist), or the replica is no policy
    replica (a judge: it serves another model and never takes the policy's weights)."""


class ReplicaSync:
    """The state of one controller: the newest version seen and what the replica serves."""

    def __init__(self, replica_url: str, *, request_timeout_s: float = 600.0) -> None:
        self.url = replica_url.rstrip("/")
        self.timeout = request_timeout_s
        self.newest: PolicyVersion | None = None
        self.served: int | None = None
        self.awaiting = False  # started for broadcast weights, holds none of the trainer's yet
        self.receivers = 1  # processes that receive a broadcast (a vLLM replica's workers)
        self.dtype: str | None = None  # the dtype it serves (None: it does not say)
        self.backends: tuple[str, ...] = ("gloo",)  # the groups it can receive over
        self.fallback = False  # its last grant failed: the next checkpoint it can read first
        self.rejected: set[int] = set()
        self.applied: list[int] = []

    def observe(self, event: PolicyVersion) -> None:
        new = self.newest
        restarted = (
            event.transfer is not None
            and new is not None
            and (new.transfer is None or new.transfer.session != event.transfer.session)
        )
        # The trainer publishes a version again when it checkpoints it after the fact (at a
        # clean stop): that record names the checkpoint a replica that missed the transfer
        # takes, so it replaces the one held.
        checkpointed = new is not None and event.version == new.version and bool(event.path)
        if new is None or event.version > new.version or restarted or checkpointed:
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
        if (role := body.get("role", "policy")) != "policy":
            raise SyncError(f"replica {self.url} is a {role} replica: it follows no policy")
        self.served = int(body.get("version", 0))
        self.awaiting = bool(body.get("awaiting_weights", False))
        self.receivers = max(1, int(body.get("receivers", self.receivers)))
        self.dtype = _DTYPES.get(str(body.get("dtype")))
        backends = body.get("transfer_backends", ["gloo"])
        if isinstance(backends, list):
            self.backends = tuple(b for b in backends if b in ("gloo", "nccl"))
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
        self._loaded(new.version, new.path, started)
        return True

    def post_grant(self, grant: dict[str, Any]) -> bool:
        """Post the trainer's grant: the replica receives over its group and loads; True when
        it now serves the granted version (a failure is logged; the next grant retries)."""
        version, started = int(grant["version"]), time.monotonic()
        try:
            self._request("POST", "/update_weights", {"version": version, "transfer": grant})
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            log.warning("replica %s did not take version %d: %s", self.url, version, detail)
            return False
        except (OSError, ValueError) as exc:
            log.warning("replica %s unreachable for version %d: %s", self.url, version, exc)
            self.served = None
            return False
        self._loaded(version, f"broadcast {grant.get('address')}", started)
        return True

    def _loaded(self, version: int, source: str, started: float) -> None:
        self.served, self.awaiting = version, False
        self.applied.append(version)
        log.info(
            "replica %s now serves version %d from %s (%.2fs)",
            self.url,
            version,
            source,
            time.monotonic() - started,
        )

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            parsed = json.loads(response.read() or b"{}")
        return parsed if isinstance(parsed, dict) else {}


class GrantClient:
    """One controller's standing want at the trainer's store: connects to the store announced on
    `rl.policy`, keeps one want standing for its replica (the version it serves, its receiving
    ranks) and returns the grant that answers it. The controller posts the grant to its replica
    and, once that returns, a new want: at the trainer's next version the replica is waiting."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self._at: WeightTransfer | None = None
        self._store: Any = None
        self._want: Want | None = None

    def connect(self, transfer: WeightTransfer) -> None:
        """Talk to the store `transfer` announces (reconnects when the trainer changed)."""
        if self._store is not None and self._at == transfer:
            return
        import torch.distributed as dist

        from workers.weights.group import store_client

        self.close()
        client = store_client(transfer.address, CONNECT_TIMEOUT_S)
        self._store = dist.PrefixStore(transfer.session + "/", client)
        self._at = transfer
        log.info("replica %s: weights from %s (session %s)", self.replica, *self._key())

    def _key(self) -> tuple[str, str]:
        assert self._at is not None
        return self._at.address, self._at.session

    def want(
        self,
        version: int,
        ranks: int,
        dtype: str | None = None,
        backends: tuple[str, ...] = ("gloo",),
    ) -> None:
        """Keep a want standing for a replica serving `version` (-1: none of the trainer's)
        in `dtype`, whose `ranks` processes receive over one of `backends`."""
        fresh = (version, ranks, dtype, tuple(backends))
        if self._want is not None and (
            (self._want.version, self._want.ranks, self._want.dtype, self._want.backends) == fresh
        ):
            return
        first = self._want is None
        self._want = Want(self.replica, uuid.uuid4().hex, version, ranks, dtype, tuple(backends))
        self._store.set(want_key(self.replica), self._want.dumps())
        if first:
            self._store.append(MEMBERS, self.replica + "\n")

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """The grant answering the standing want, if it comes within `timeout_s`."""
        import torch.distributed as dist

        if self._want is None:
            return None
        key = grant_key(self._want.nonce)
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except dist.DistStoreError:  # not yet (a timeout): the want stays
            return None
        raw = self._store.get(key)
        self._store.delete_key(key)
        nonce, self._want = self._want.nonce, None  # granted: the next want is a new one
        try:
            return Grant.loads(raw).as_dict()
        except ValueError as exc:
            log.error("replica %s: unreadable grant for want %s: %s", self.replica, nonce, exc)
            return None

    def close(self) -> None:
        self._store, self._at, self._want = None, None, None


def quiet_store_warnings() -> None:
    """In a process of its own (`rollout replica sync`), before torch loads: torch's C++ logs
    below ERROR are left out (`TORCH_CPP_LOG_LEVEL`, read once, when torch loads; a setting of
    the user's wins). Torch is used there only for the trainer's store, and when the trainer
    stops, its client logs the dropped connection as a warning with a C++ stack of some 25
    lines. The controller already says the same in one line. Not for a controller embedded
    beside a replica: torch is loaded there, and its children would inherit the setting."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


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
        grants: GrantClient | None = None
        while not stop_event.is_set():
            broadcast = sync.newest is not None and sync.newest.transfer is not None
            # Under broadcast the wait for a grant paces the loop (up to poll_timeout_s).
            wait_ms = 50 if broadcast else int(poll_timeout_s * 1000)
            for event in await follower.poll(timeout_ms=wait_ms):
                if isinstance(event, PolicyVersion):
                    sync.observe(event)
            now = time.monotonic()
            if sync.served is None or now - last_health > health_interval_s:
                await asyncio.to_thread(sync.refresh)
                last_health = now
            if broadcast:
                grants = grants or GrantClient(sync.url)
                if await asyncio.to_thread(_broadcast_step, sync, grants, poll_timeout_s):
                    backoff = 0.5
                else:
                    await asyncio.to_thread(stop_event.wait, backoff)
                    backoff = min(backoff * 2, 30.0)
            elif sync.due():
                if await asyncio.to_thread(sync.apply):
                    backoff = 0.5
                else:
                    await asyncio.to_thread(stop_event.wait, backoff)
                    backoff = min(backoff * 2, 30.0)
    finally:
        await follower.stop()


def _broadcast_step(sync: ReplicaSync, grants: GrantClient, wait_s: float) -> bool:
    """One round under broadcast (in a thread): take a readable checkpoint where one serves
    (below), keep the want standing, post a grant that came. False when the trainer's store
    cannot be reached (the caller backs off).

    The checkpoint way is offered every round until it serves or the replica rejects that
    checkpoint (4xx): a load that failed for a moment (5xx, unreachable) is offered again,
    since a replica the trainer never saw join gets nothing else once the trainer is gone."""
    new = sync.newest
    assert new is not None and new.transfer is not None
    if sync.served is None:  # the replica does not answer: nothing to want for yet
        time.sleep(min(wait_s, 1.0))
        return True
    checkpoint_way = sync.awaiting or ((sync.fallback or not sync.backends) and sync.due())
    if (
        checkpoint_way
        and new.path
        and new.version not in sync.rejected
        and os.access(new.path, os.R_OK | os.X_OK)
        and sync.apply()
    ):
        sync.fallback = False
        return True
    if not sync.backends:  # it takes no broadcast: checkpoints only
        time.sleep(min(wait_s, 1.0))
        return True
    try:
        grants.connect(new.transfer)
        grants.want(-1 if sync.awaiting else sync.served, sync.receivers, sync.dtype, sync.backends)
        grant = grants.wait(wait_s)
    except (RuntimeError, OSError) as exc:  # torch's store errors: the trainer is gone
        why = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        log.warning("replica %s: weight store %s: %s", sync.url, new.transfer.address, why)
        grants.close()
        return False
    if grant is not None:
        sync.fallback = not sync.post_grant(grant)
    return True


#: dtype names of vLLM's `--dtype` (and torch's) → the names a want carries.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def _json_body(exc: urllib.error.HTTPError) -> dict[str, Any]:
    """The JSON object an HTTP error carries ({} when it carries none)."""
    try:
        parsed = json.loads(exc.read() or b"{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
