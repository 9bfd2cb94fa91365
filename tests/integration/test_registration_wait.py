"""A replica whose engine becomes healthy late (a large model compiling, or waiting for its
first broadcast weights) is registered on `rl.replicas` once it is healthy, however long
that took: the registration waits as long as the replica runs.

Real broker; the engine is a stub HTTP server whose `/health` answers 503 for a while, then
200. The times are scaled down: a registration with a deadline below the engine's start
(as the 600 s one was below vLLM's 1,200 s) is shown to give up on the same engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from schemas import decode
from schemas.events import ReplicaInfo
from tests.integration.trainer_helpers import read_all
from workers.llm.engines.registration import ReplicaRegistration
from workers.ports import free_port

pytestmark = [pytest.mark.kafka]

HEALTHY_AFTER_S = 3.0


def _late_engine(healthy_after_s: float) -> tuple[ThreadingHTTPServer, str]:
    ready_at = time.monotonic() + healthy_after_s

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" and time.monotonic() >= ready_at
            body = json.dumps({"status": "ok" if ok else "starting", "version": 0}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
def late_engines() -> Iterator[list[ThreadingHTTPServer]]:
    servers: list[ThreadingHTTPServer] = []
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_replica_healthy_after_the_old_deadline_is_registered_once_healthy(
    kafka_config, topics_config, late_engines
) -> None:
    topic = topics_config.name("replicas")
    registrations = {}
    for rid, timeout_s in (("late", None), ("deadline", 1.0)):
        server, address = _late_engine(HEALTHY_AFTER_S)
        late_engines.append(server)
        info = ReplicaInfo(replica_id=rid, address=address, backend="vllm", model="m", version=0)
        registrations[rid] = ReplicaRegistration(kafka_config, topic, info)
        registrations[rid].start(timeout_s)  # None: the replica's default, as long as it runs
    began = time.monotonic()
    assert registrations["late"].registered.wait(timeout=30), "never registered"
    assert time.monotonic() - began >= HEALTHY_AFTER_S - 0.5  # not before it was healthy
    time.sleep(1.0)
    assert not registrations["deadline"].registered.is_set()  # a deadline gave up on it
    records = read_all(kafka_config, topic, timeout_s=2)
    announced = {r.key.decode(): decode(r.value) for r in records if r.value is not None}
    assert sorted(announced) == ["late"], announced
    assert announced["late"].address == registrations["late"].info.address
    for registration in registrations.values():
        registration.leave()
