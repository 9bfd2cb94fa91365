"""Helpers for agent-loop tests: a scripted replica, running a worker, reading turns back."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from aiohttp import web
from kafka import TopicPartition

from schemas import PromptEvent, TurnEvent, decode, encode, headers_for
from tests.conftest import free_port
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.config import KafkaConfig


class ScriptedReplica:
    """A real HTTP server speaking the replica contract whose answers are scripted.

    `script(prompt_text) -> answer_text`; the answer is tokenized with the real tokenizer and
    cut after the first stop token (the request's, or the tokenizer's eos), as a real engine
    would. Every token's logprob is -0.5.
    """

    def __init__(self, tokenizer: Any, script: Callable[[str], str], version: int = 0) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.version = version
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.requests: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None

    async def start(self) -> ScriptedReplica:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/is_paused", self.is_paused)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": self.version})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": False})

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        text = self.tokenizer.decode(body["prompt"], skip_special_tokens=False)
        answer = self.tokenizer.encode(self.script(text), add_special_tokens=False)
        stops = set(body.get("stop_token_ids") or []) | {self.tokenizer.eos_token_id}
        out, finish, stop_reason = [], "length", None
        for tok in answer[: body.get("max_tokens", 16)]:
            out.append(tok)
            if tok in stops:
                finish, stop_reason = "stop", tok
                break
        return web.json_response(
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "created": 0,
                "model": "scripted",
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": out,
                        "logprobs": {"token_logprobs": [-0.5] * len(out)},
                        "finish_reason": finish,
                        "stop_reason": stop_reason,
                    }
                ],
                "policy_version": self.version,
            }
        )


def produce_prompts(kafka: KafkaConfig, topic: str, prompts: list[PromptEvent | bytes]) -> None:
    producer = make_producer(kafka)
    for prompt in prompts:
        if isinstance(prompt, bytes):
            producer.send(topic, key=b"raw", value=prompt)
        else:
            producer.send(topic, key=prompt.uid, value=encode(prompt), headers=headers_for(prompt))
    producer.flush()
    producer.close()


class TurnReader:
    """Reads a turns topic from its beginning, its partitions assigned at once (a subscribing
    reader is assigned inside a poll, which on a loaded machine can come after the run it
    watches): `with TurnReader(kafka, topic) as r: ...; r.read(until=...)`."""

    def __init__(self, kafka: KafkaConfig, topic: str) -> None:
        self.consumer = make_consumer(kafka, group_id=None, name="test-turns")
        parts = self.consumer.partitions_for_topic(topic) or set()
        self.consumer.assign([TopicPartition(topic, p) for p in sorted(parts)])
        self.consumer.seek_to_beginning()
        self.turns: list[TurnEvent] = []

    def read(
        self, *, until: Callable[[list[TurnEvent]], bool], timeout_s: float = 120.0
    ) -> list[TurnEvent]:
        """Every turn read so far, once `until(turns)` holds or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not until(self.turns):
            for records in self.consumer.poll(timeout_ms=100).values():
                self.turns.extend(decode(r.value) for r in records)
        return self.turns

    def __enter__(self) -> TurnReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.close()


def read_turns(
    kafka: KafkaConfig,
    topic: str,
    *,
    until: Callable[[list[TurnEvent]], bool],
    timeout_s: float = 120.0,
) -> list[TurnEvent]:
    with TurnReader(kafka, topic) as reader:
        return reader.read(until=until, timeout_s=timeout_s)


def finals_by_sample(turns: list[TurnEvent]) -> dict[tuple[str, int], list[str]]:
    """(uid, sample_index) → attempt ids that completed."""
    out: dict[tuple[str, int], list[str]] = defaultdict(list)
    for turn in turns:
        if turn.final:
            out[(turn.uid, turn.sample_index)].append(turn.attempt_id)
    return out


def trajectory(turns: list[TurnEvent], uid: str, index: int, attempt: str) -> list[TurnEvent]:
    mine = [
        t for t in turns if t.uid == uid and t.sample_index == index and t.attempt_id == attempt
    ]
    return sorted(mine, key=lambda t: t.turn_index)


async def run_worker_until(worker: Any, done: Callable[[], bool], timeout_s: float = 120.0) -> None:
    task = asyncio.create_task(worker.run())
    deadline = time.monotonic() + timeout_s
    try:
        while not done() and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.25)
    finally:
        worker.stop()
        await asyncio.wait_for(task, timeout=60)
