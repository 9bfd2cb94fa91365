"""The gate's client of its server never sends a generation on a connection the server dropped.

uvicorn, under vLLM and SGLang, closes a keep-alive connection once it has been idle for its
timeout (5 s). A POST that reaches a connection at that moment fails with "Server disconnected",
and aiohttp retries only idempotent methods. The server here makes that moment certain: a
request arriving on a connection idle for `SERVER_KEEPALIVE_S` or more is dropped unanswered,
as the real server's timer would drop it. `Upstream` must have opened a new connection by then.
"""

from __future__ import annotations

import asyncio

from workers.llm.engines.upstream import KEEPALIVE_S, Upstream

SERVER_KEEPALIVE_S = KEEPALIVE_S + 1.0  # stricter than uvicorn's 5 s, so the test is short
BODY = b'{"ok": true}'
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)


class KeepAliveServer:
    """HTTP/1.1 on a raw socket: answers every request, keeps the connection, and drops one
    that a request reaches after `SERVER_KEEPALIVE_S` of idleness."""

    def __init__(self) -> None:
        self.connections = 0
        self.dropped = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        loop = asyncio.get_running_loop()
        answered_at: float | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if answered_at is not None and loop.time() - answered_at >= SERVER_KEEPALIVE_S:
                    self.dropped += 1
                    return  # the keep-alive timer fired as the request came in
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(RESPONSE)
                await writer.drain()
                answered_at = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_generation_after_an_idle_spell_goes_on_a_live_connection() -> None:
    fake = KeepAliveServer()
    server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = Upstream(f"http://127.0.0.1:{port}")
    await upstream.start()
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        assert await upstream.request("POST", "/v1/completions", json=body) == (200, {"ok": True})
        assert await upstream.request("POST", "/v1/completions", json=body) == (200, {"ok": True})
        assert fake.connections == 1  # kept alive while in use

        await asyncio.sleep(SERVER_KEEPALIVE_S + 0.2)
        assert await upstream.request("POST", "/v1/completions", json=body) == (200, {"ok": True})
        assert fake.dropped == 0
        assert fake.connections == 2
    finally:
        await upstream.close()
        server.close()
        await server.wait_closed()
