"""`ReplicaSync`: which policy version a replica is told to load, and when.

The controller talks to its replica over the replica contract (`workers.llm.contract`):
`GET /health` for the version served and `POST /update_weights` to load one (the replica
pauses, loads, sets the version and resumes). `FakeReplica` serves those two endpoints on a
loopback port from memory, so every decision is checked against what the replica was
actually asked. Following the policy topic (`run_controller`) needs a broker:
tests/integration/test_trainer.py::test_controller_moves_a_replica_to_the_published_version.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from schemas.events import PolicyVersion, WeightTransfer
from workers.weights.sync import ReplicaSync


class FakeReplica:
    """A replica's `/health` and `/update_weights`, from memory.

    `answers` queues the status of the next `/update_weights` calls (200 when empty: the
    version is loaded); `health` overrides the `/health` body.
    """

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.posted: list[dict[str, Any]] = []
        self.answers: list[int] = []
        self.health: dict[str, Any] | None = None
        self.health_status = 200
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/health":
                    return self._send(404, {"error": {"message": "no such route"}})
                body = replica.health or {"status": "ok", "version": replica.version, "load": 0}
                self._send(replica.health_status, body)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                if self.path != "/update_weights":
                    return self._send(404, {"error": {"message": "no such route"}})
                replica.posted.append(body)
                status = replica.answers.pop(0) if replica.answers else 200
                if status != 200:
                    return self._send(status, {"error": {"message": f"refused with {status}"}})
                replica.version = body["version"]
                self._send(200, {"status": "ok", "version": replica.version})

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def replica(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeReplica]:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    fake = FakeReplica()
    yield fake
    fake.stop()


def policy(version: int) -> PolicyVersion:
    return PolicyVersion(version=version, path=f"/ckpt/step-{version}")


def synced(replica: FakeReplica, *versions: int) -> ReplicaSync:
    """A controller that has read `versions` from the policy topic and the replica's health."""
    sync = ReplicaSync(replica.url + "/", request_timeout_s=5)
    for v in versions:
        sync.observe(policy(v))
    sync.refresh()
    return sync


# ------------------------------------------------------------------ which version


def test_the_newest_version_seen_wins_whatever_the_order() -> None:
    sync = ReplicaSync("http://replica")
    assert sync.newest is None
    events = [policy(v) for v in (3, 1, 5, 4)]
    for event in events:
        sync.observe(event)
    assert sync.newest is events[2]
    assert (sync.newest.version, sync.newest.path) == (5, "/ckpt/step-5")


def test_nothing_is_due_before_a_version_is_seen(replica: FakeReplica) -> None:
    sync = synced(replica)
    assert sync.served == 0
    assert not sync.due()


def test_nothing_is_due_while_the_replica_does_not_answer() -> None:
    sync = ReplicaSync("http://replica")
    sync.observe(policy(2))
    assert sync.served is None
    assert not sync.due()


@pytest.mark.parametrize(("served", "due"), [(0, True), (2, True), (3, False), (4, False)], ids=str)
def test_due_only_when_the_newest_is_newer_than_what_is_served(
    replica: FakeReplica, served: int, due: bool
) -> None:
    replica.version = served
    sync = synced(replica, 1, 3)
    assert sync.served == served
    assert sync.due() is due


# ------------------------------------------------------------------ reading /health


def test_refresh_reads_the_served_version(replica: FakeReplica) -> None:
    replica.version = 7
    sync = ReplicaSync(replica.url, request_timeout_s=5)
    assert sync.refresh() == 7
    assert sync.served == 7


def test_a_replica_that_went_away_serves_nothing(replica: FakeReplica) -> None:
    sync = synced(replica, 1)
    assert sync.served == 0
    replica.stop()
    assert sync.refresh() is None
    assert sync.served is None
    assert not sync.due()


# ------------------------------------------------------------------ loading


def test_apply_posts_the_newest_version_once(replica: FakeReplica) -> None:
    sync = synced(replica, 1, 2, 3)
    assert sync.due()
    assert sync.apply() is True
    # Intermediate versions are skipped: only the newest is loaded.
    assert replica.posted == [{"path": "/ckpt/step-3", "version": 3}]
    assert replica.version == 3
    assert (sync.served, sync.applied) == (3, [3])
    # Idempotent: neither a re-read of /health nor an older version makes it due again.
    assert sync.refresh() == 3
    sync.observe(policy(2))
    assert not sync.due()
    assert len(replica.posted) == 1


def test_a_newer_version_is_loaded_after_the_first(replica: FakeReplica) -> None:
    sync = synced(replica, 1)
    assert sync.apply()
    sync.observe(policy(4))
    assert sync.due() and sync.apply()
    assert [p["version"] for p in replica.posted] == [1, 4]
    assert sync.applied == [1, 4] and replica.version == 4


def test_a_replica_that_restarted_older_is_brought_back(replica: FakeReplica) -> None:
    sync = synced(replica, 3)
    assert sync.apply()
    replica.version = 0  # restarted from its initial weights
    assert sync.refresh() == 0
    assert sync.due() and sync.apply()
    assert [p["version"] for p in replica.posted] == [3, 3]
    assert replica.version == 3


@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_rejected_checkpoint_is_not_retried(replica: FakeReplica, status: int) -> None:
    replica.answers = [status]
    sync = synced(replica, 2)
    assert sync.apply() is False
    assert sync.rejected == {2}
    assert sync.served == 0 and sync.applied == []
    assert not sync.due()
    # A newer version is still loaded.
    sync.observe(policy(3))
    assert sync.due() and sync.apply()
    assert [p["version"] for p in replica.posted] == [2, 3]


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_failed_load_stays_due_and_is_retried(replica: FakeReplica, status: int) -> None:
    replica.answers = [status]
    sync = synced(replica, 2)
    assert sync.apply() is False
    assert sync.rejected == set()
    assert sync.served == 0 and sync.applied == []
    assert sync.due()
    assert sync.apply() is True
    assert [p["version"] for p in replica.posted] == [2, 2]
    assert (sync.served, sync.applied) == (2, [2])


def test_an_unreachable_replica_waits_for_its_health(replica: FakeReplica) -> None:
    sync = synced(replica, 2)
    replica.stop()
    assert sync.apply() is False
    assert sync.served is None and sync.rejected == set()
    assert not sync.due()  # until /health answers again


def test_a_replica_unhealthy_after_a_failed_load_is_retried(replica: FakeReplica) -> None:
    """vLLM's adapter answers /health with 503 and the version it still serves after a
    failed load: the load stays due (it was taken for a replica not answering, never retried)."""
    replica.answers = [500]
    sync = synced(replica, 1)
    assert sync.due() and not sync.apply()
    replica.health_status = 503
    replica.health = {"status": "unavailable", "version": 0, "reason": "weight update failed"}
    assert sync.refresh() == 0 and sync.due()
    assert sync.apply() and replica.version == 1
    replica.health = {"status": "unavailable", "version": 0, "reason": "starting"}
    assert sync.refresh() is None and not sync.due()  # starting: nothing to load into yet


# ------------------------------------------------------------------ broadcast weights


def announced(
    version: int, session: str, path: str = "", address: str = "127.0.0.1:1"
) -> PolicyVersion:
    transfer = WeightTransfer(address=address, session=session)
    return PolicyVersion(version=version, path=path, transfer=transfer)


def test_under_broadcast_a_restarted_trainer_wins_even_with_an_older_version() -> None:
    sync = ReplicaSync("http://replica")
    for event in (announced(3, "s1"), announced(5, "s1"), announced(4, "s1")):
        sync.observe(event)
    assert sync.newest is not None and sync.newest.version == 5
    sync.observe(announced(2, "s2"))  # resumed from an older checkpoint: its version is the truth
    assert (sync.newest.version, sync.newest.transfer.session) == (2, "s2")
    sync.observe(announced(1, "s2"))
    assert sync.newest.version == 2


def test_refresh_reads_a_replica_awaiting_its_first_weights(replica: FakeReplica) -> None:
    replica.health_status = 503
    replica.health = {
        "status": "unavailable",
        "version": 0,
        "reason": "awaiting weights",
        "awaiting_weights": True,
        "receivers": 2,
    }
    sync = ReplicaSync(replica.url, request_timeout_s=5)
    assert sync.refresh() == 0 and sync.awaiting and sync.receivers == 2
    replica.health_status, replica.health = 200, None
    assert sync.refresh() == 0 and not sync.awaiting and sync.receivers == 2


def test_the_controller_wants_posts_the_grant_and_wants_again(replica: FakeReplica) -> None:
    """Against a real rendezvous store (the trainer's hub): an awaiting replica wants with
    version -1, the grant goes to the replica as `{version, transfer}`, and the next want says
    the version it now serves. (The fake replica receives nothing: the hub drops it.)"""
    import threading

    import torch

    from workers.weights.hub import TransferHub
    from workers.weights.sync import GrantClient, _broadcast_step

    hub = TransferHub(host="127.0.0.1", port=0, session="s", timeout_s=1.0, bucket_bytes=1024)
    replica.health_status = 503
    replica.health = {"status": "unavailable", "version": 0, "awaiting_weights": True}
    sync = ReplicaSync(replica.url, request_timeout_s=5)
    event = PolicyVersion(
        version=3, path="/nowhere/step-3", transfer=WeightTransfer(address=hub.address, session="s")
    )
    sync.observe(event)
    sync.refresh()
    grants = GrantClient(sync.url)
    try:
        assert _broadcast_step(sync, grants, wait_s=0.1)
        (want,) = hub.pending()
        assert (want.replica, want.version, want.ranks) == (sync.url, -1, 1)
        assert replica.posted == []  # the announced checkpoint is not readable here
        sending = threading.Thread(
            target=hub.send, args=([("w", torch.zeros(4))], 3, hub.pending())
        )
        sending.start()
        replica.health_status, replica.health = 200, None
        assert _broadcast_step(sync, grants, wait_s=5.0)
        sending.join()
        (posted,) = replica.posted
        assert posted["version"] == 3 and posted["transfer"]["version"] == 3
        assert (sync.served, sync.awaiting, sync.applied) == (3, False, [3])
        assert _broadcast_step(sync, grants, wait_s=0.1)
        assert [w.version for w in hub.pending()] == [3]  # the next want: it serves 3
    finally:
        grants.close()
        hub.close()


def test_the_want_says_the_dtype_and_groups_and_a_failed_grant_falls_back_to_the_checkpoint(
    replica: FakeReplica, tmp_path: Any
) -> None:
    """A vLLM-like replica says bf16 and NCCL in /health: its want carries both. A grant it
    fails (the adapter answers 500) makes the next version that names a readable checkpoint
    load from disk, not wait for a grant; a replica that takes no broadcast (SGLang) never
    wants and takes readable checkpoints as they come."""
    from workers.weights.hub import TransferHub
    from workers.weights.sync import GrantClient, _broadcast_step

    hub = TransferHub(host="127.0.0.1", port=0, session="s", timeout_s=1.0, bucket_bytes=1024)
    replica.health = {"status": "ok", "version": 2, "load": 0, "dtype": "bfloat16"}
    replica.health |= {"transfer_backends": ["gloo", "nccl"]}
    announced = WeightTransfer(address=hub.address, session="s")
    sync = ReplicaSync(replica.url, request_timeout_s=5)
    sync.observe(PolicyVersion(version=3, path="", transfer=announced))
    sync.refresh()
    grants = GrantClient(sync.url)
    try:
        assert _broadcast_step(sync, grants, wait_s=0.1)
        (want,) = hub.pending()
        assert (want.dtype, want.backends, want.version) == ("bfloat16", ("gloo", "nccl"), 2)
        replica.answers = [500]
        grant = {"version": 3, "transfer": 1, "address": hub.address, "session": "s"}
        grant |= {"group": "g", "manifest": "m", "rank": 1, "world": 2, "timeout_s": 1.0}
        assert not sync.post_grant(grant)  # the replica failed it
        sync.fallback = True  # as _broadcast_step sets it from post_grant's answer
        checkpoint = tmp_path / "step-4"
        checkpoint.mkdir()
        sync.observe(PolicyVersion(version=4, path=str(checkpoint), transfer=announced))
        assert _broadcast_step(sync, grants, wait_s=0.1)
        assert replica.posted[-1] == {"path": str(checkpoint), "version": 4}
        assert not sync.fallback and sync.served == 4

        replica.health = {"status": "ok", "version": 4, "load": 0, "transfer_backends": []}
        sync.refresh()
        assert sync.backends == ()
        checkpoint = tmp_path / "step-5"
        checkpoint.mkdir()
        sync.observe(PolicyVersion(version=5, path=str(checkpoint), transfer=announced))
        wanted = [w.nonce for w in hub.pending()]
        assert _broadcast_step(sync, grants, wait_s=0.1)
        assert replica.posted[-1] == {"path": str(checkpoint), "version": 5}
        assert _broadcast_step(sync, grants, wait_s=0.1)  # nothing more to want
        assert [w.nonce for w in hub.pending()] == wanted
    finally:
        grants.close()
        hub.close()


def test_a_version_published_again_with_its_checkpoint_replaces_the_one_without() -> None:
    """At a clean stop the trainer checkpoints the last version and publishes it again, now
    naming the checkpoint: a replica that missed its transfer needs that record."""
    sync = ReplicaSync("http://replica")
    sync.observe(announced(3, "s1", path=""))
    again = announced(3, "s1", path="/ckpt/step-3")
    sync.observe(again)
    assert sync.newest is again
    sync.observe(announced(3, "s1", path=""))  # a record without a checkpoint takes none away
    assert sync.newest is again


def test_a_replica_the_trainer_never_saw_takes_the_last_checkpoint_after_the_trainer_is_gone(
    replica: FakeReplica, tmp_path: Any
) -> None:
    """The trainer ran its steps before this replica's controller reached its store, and
    exited: the store is gone and the replica awaits its first weights. The last version, as
    published again with its checkpoint, is loaded from disk; a load that failed once (503)
    is offered again at the next round, not given up."""
    import socket

    from workers.weights.sync import GrantClient, _broadcast_step

    with socket.socket() as probe:  # a port with no store behind it
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    checkpoint = tmp_path / "step-3"
    checkpoint.mkdir()
    replica.health_status = 503
    replica.health = {"status": "unavailable", "version": 0, "awaiting_weights": True}
    sync = ReplicaSync(replica.url, request_timeout_s=5)
    for path in ("", str(checkpoint)):
        sync.observe(announced(3, "s1", path=path, address=gone))
    sync.refresh()
    grants = GrantClient(sync.url)
    replica.answers = [503]
    assert not _broadcast_step(sync, grants, wait_s=0.1)  # the load failed, the store is gone
    assert _broadcast_step(sync, grants, wait_s=0.1)
    assert replica.posted == [{"path": str(checkpoint), "version": 3}] * 2
    assert (sync.served, sync.awaiting) == (3, False)
