"""`schemas.stale`: one header scheme for the groups dropped to `rl.stale`, by either stage."""

from __future__ import annotations

from schemas import headers as h
from schemas.stale import describe_drop, drop_headers, is_trainer_drop


def test_a_replay_drop_carries_reason_and_staleness_and_no_trainer_version() -> None:
    envelope = [(h.KIND, b"group")]
    out = drop_headers(envelope, "zero_variance", 1)
    assert dict(out) == {h.KIND: b"group", h.STALENESS: b"1", h.DROP_REASON: b"zero_variance"}
    assert not is_trainer_drop(out)
    assert describe_drop(out) == "replay: zero_variance (staleness 1)"


def test_a_trainer_drop_replaces_the_replay_stages_staleness_and_says_who_dropped_it() -> None:
    from_replay = [(h.KIND, b"group"), (h.STALENESS, b"0")]
    out = drop_headers(from_replay, "stale", 33, trainer_version=40)
    assert [k for k, _ in out].count(h.STALENESS) == 1
    assert dict(out)[h.STALENESS] == b"33" and dict(out)[h.DROP_TRAINER_VERSION] == b"40"
    assert is_trainer_drop(out)
    assert describe_drop(out) == "trainer: stale (staleness 33)"
    again = drop_headers(out, "stale", 34, trainer_version=41)  # no header twice
    assert sorted(k for k, _ in again) == sorted(k for k, _ in out)


def test_records_without_headers_are_upstream_drops_of_unknown_reason() -> None:
    assert not is_trainer_drop(None)
    assert describe_drop(None) == "replay: ? (staleness None)"
