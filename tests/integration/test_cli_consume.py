"""`rollout consume` reads and never writes: undecodable records are shown with their error
(not dead-lettered), and dead letters are shown with their stage, cause and origin."""

from __future__ import annotations

import json

import pytest
from kafka import TopicPartition

from schemas.codec import encode, headers_for
from schemas.deadletter import DeadLetter
from schemas.events import ChatMessage, PromptEvent
from tests.conftest import run_cli
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = pytest.mark.kafka


def _end_offset(kafka: KafkaConfig, topic: str) -> int:
    consumer = make_consumer(kafka, group_id=None, name="test-end")
    try:
        tp = TopicPartition(topic, 0)
        return consumer.end_offsets([tp])[tp]
    finally:
        consumer.close()


def _consume(
    kafka: KafkaConfig, topics: TopicsConfig, *args: str, read: int | None = None
) -> list[dict]:
    """`rollout consume` on the run's topics; it returns as soon as it has shown `--limit`
    records (else after 8 s); `read`: how many records it must have read in all."""
    flags = ["--bootstrap", kafka.bootstrap, "--set", f"topics.prefix={topics.prefix}"]
    done = run_cli(*flags, "consume", "--timeout", "8", *args)
    assert done.returncode == 0, done.stderr
    if read is not None:
        assert f"consumed {read} records" in done.stderr, done.stderr  # the filter saw them
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_consume_shows_bad_records_and_dead_letters_and_writes_nothing(
    kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    prompts, dlq = topics_config.name("prompts"), topics_config.name("dlq")
    good = PromptEvent(
        uid="u-1", prompt=[ChatMessage(role="user", content="1+1?")], data_source="openai/gsm8k"
    )
    letter = DeadLetter(
        stage="reward",
        topic=topics_config.name("turns"),
        partition=0,
        offset=41,
        error_class="DecodeError",
        error_message="turn 0 has no prompt",
        error_cause="missing_prompt",
        value=b"\xff\xfe not utf-8",
    )
    producer = make_producer(kafka_config, name="test")  # both prompts on partition 0: in order
    try:
        producer.send(prompts, key="bad", value=b"{not json", partition=0).get(timeout=30)
        producer.send(
            prompts, key="u-1", value=encode(good), headers=headers_for(good), partition=0
        ).get(timeout=30)
        producer.send(dlq, key=None, value=letter.value, headers=letter.headers()).get(30)
    finally:
        producer.close()
    dlq_end = _end_offset(kafka_config, dlq)
    assert dlq_end == 1

    for _ in range(2):  # reading twice changes nothing either
        rows = _consume(kafka_config, topics_config, "--topic", "prompts", "--limit", "2")
        assert _end_offset(kafka_config, dlq) == dlq_end
    bad, shown = rows
    assert bad["undecodable"]["value"] == "{not json" and bad["undecodable"]["error"]
    assert (bad["topic"], bad["partition"], bad["offset"]) == (prompts, 0, 0)
    assert shown["uid"] == "u-1" and shown["kind"] == "prompt"  # an event prints as itself

    (dead,) = _consume(kafka_config, topics_config, "--topic", "dlq", "--limit", "1")
    assert dead["dead_letter"] == {
        "stage": "reward",
        "cause": "missing_prompt",
        "error_class": "DecodeError",
        "error": "turn 0 has no prompt",
        "origin": {"topic": topics_config.name("turns"), "partition": 0, "offset": 41},
    }
    assert "value_base64" in dead["undecodable"]  # the original bytes, kept as they were
    dlq_args = ("--topic", "dlq", "--limit", "1")
    assert _consume(kafka_config, topics_config, *dlq_args, "--cause", "missing_prompt")
    assert not _consume(kafka_config, topics_config, *dlq_args, "--cause", "json", read=1)
    assert not _consume(kafka_config, topics_config, *dlq_args, "--stage", "agent-loop", read=1)
    assert _end_offset(kafka_config, dlq) == dlq_end
