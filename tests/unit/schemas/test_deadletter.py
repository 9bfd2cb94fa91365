"""`DeadLetter`: built from a consumed record, written as headers, read back."""

from __future__ import annotations

from collections import namedtuple

from schemas.deadletter import DeadLetter
from schemas.errors import DecodeError
from schemas.headers import KIND

Record = namedtuple("Record", "topic partition offset key value headers")


def test_a_record_letter_keeps_the_bytes_and_headers_and_reads_back() -> None:
    record = Record("rl.turns", 3, 41, b"t/0", b"\xff not json", [(KIND, b"turn")])
    exc = DecodeError("not JSON", cause="json")
    letter = DeadLetter.of_record("reward", record, exc)
    assert (letter.key, letter.value, letter.error_cause) == (b"t/0", b"\xff not json", "json")
    assert (letter.topic, letter.partition, letter.offset) == ("rl.turns", 3, 41)
    back = DeadLetter.from_message(letter.headers(), letter.key, letter.value)
    assert back == letter


def test_cause_and_value_can_be_given_and_str_keys_become_bytes() -> None:
    record = Record("rl.prompts", 0, 7, "uid-1", "text", None)
    letter = DeadLetter.of_record("agent-loop", record, ValueError("bad"), cause="mine", value=b"v")
    assert (letter.key, letter.value, letter.error_cause) == (b"uid-1", b"v", "mine")
    assert letter.error_class == "ValueError" and letter.original_headers == []
    plain = DeadLetter.of_record("agent-loop", record, ValueError())
    assert plain.value == b"text" and plain.error_cause == "error"
    assert plain.error_message == "ValueError()"  # an exception without a message
