"""Every schema through the real broker, and bad input into the dead-letter topic."""

from __future__ import annotations

import time

import pytest

from schemas import PromptEvent, decode, encode, headers_for
from schemas import headers as h
from schemas.deadletter import DeadLetter
from tests.unit.schemas.test_codec import make_events
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.stream import EventStream

pytestmark = pytest.mark.kafka


def drain(consumer, want: int, timeout_s: float = 30.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            got.extend(records)
    return got


def test_every_schema_round_trips_through_the_broker(kafka_config, topic_factory) -> None:
    topic = topic_factory("roundtrip")
    events = make_events()
    producer = make_producer(kafka_config)
    for event in events:
        key = getattr(event, "uid", None) or getattr(event, "replica_id", None) or "policy"
        producer.send(topic, key=key, value=encode(event), headers=headers_for(event)).get(
            timeout=30
        )
    producer.close()

    consumer = make_consumer(kafka_config, topic, group_id=None)
    records = drain(consumer, len(events))
    consumer.close()
    assert len(records) == len(events)
    for record, event in zip(records, events, strict=True):
        assert decode(record.value) == event
        headers = dict(record.headers)
        assert headers[h.KIND] == event.kind.encode()
        assert headers[h.SCHEMA] == b"1"


def test_malformed_message_lands_in_dlq_and_the_next_is_processed(
    kafka_config, topics_config
) -> None:
    source = topics_config.name("prompts")
    dlq = topics_config.name("dlq")
    valid = PromptEvent(
        uid="ok-1", prompt=[{"role": "user", "content": "hi"}], data_source="openai/gsm8k"
    )
    wrong_kind = make_events()[5]  # a PolicyVersion does not belong on the prompts topic

    producer = make_producer(kafka_config)
    producer.send(
        source,
        key="bad-1",
        value=b'{"schema_version": 1, "kind": "prompt", "uid": ',
        headers=[("trace", b"t1")],
    )
    producer.send(source, key="bad-2", value=encode(wrong_kind))
    producer.send(source, key="ok-1", value=encode(valid), headers=headers_for(valid))
    producer.flush()
    producer.close()

    received = []
    with EventStream(
        kafka_config,
        [source],
        group_id="dlq-test",
        stage="test-stage",
        dlq_topic=dlq,
        kinds=(PromptEvent,),
    ) as stream:
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            received.extend(stream.poll(timeout_ms=500))
        stream.commit()
        assert stream.dlq.count == 2
    assert [r.event.uid for r in received] == ["ok-1"]

    consumer = make_consumer(kafka_config, dlq, group_id=None)
    letters = [DeadLetter.from_message(r.headers, r.key, r.value) for r in drain(consumer, 2)]
    consumer.close()
    assert len(letters) == 2
    first, second = letters
    assert first.stage == "test-stage"
    assert first.topic == source and first.partition >= 0 and first.offset >= 0
    assert first.error_class == "DecodeError" and first.error_cause == "json"
    assert "not valid JSON" in first.error_message
    assert first.key == b"bad-1"
    assert first.value == b'{"schema_version": 1, "kind": "prompt", "uid": '
    assert ("trace", b"t1") in first.original_headers
    assert second.error_cause == "wrong_kind" and "PolicyVersion" in second.error_message
    assert second.value == encode(wrong_kind)
