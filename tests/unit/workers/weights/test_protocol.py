"""`workers.weights.protocol`: wants and grants are JSON, read back checked."""

from __future__ import annotations

import json

import pytest

from workers.weights.protocol import Grant, Want


def _grant(**change: object) -> dict:
    data = {
        "version": 3,
        "transfer": 7,
        "address": "127.0.0.1:1234",
        "session": "s",
        "group": "group/7/r",
        "manifest": "manifest/7",
        "rank": 1,
        "world": 2,
        "timeout_s": 5.0,
        "backend": "gloo",
    }
    return data | change


def test_round_trips() -> None:
    want = Want("http://r:1", "n1", -1, 2)
    assert Want.loads(want.dumps()) == want
    grant = Grant.loads(_grant())
    assert Grant.loads(grant.dumps()) == grant and grant.as_dict() == _grant() | {"env": None}
    want = Want("r", "n2", 3, 1, "bfloat16", ("gloo", "nccl"))
    assert Want.loads(want.dumps()) == want
    plain = '{"replica": "r", "nonce": "n", "version": 0, "ranks": 1}'
    assert Want.loads(plain).backends == ("gloo",)


@pytest.mark.parametrize("change", [{"dtype": "int8"}, {"backends": ["mpi"]}, {"backends": "nccl"}])
def test_a_want_with_a_bad_dtype_or_backend_is_refused(change: dict) -> None:
    data = {"replica": "r", "nonce": "n", "version": 0, "ranks": 1} | change
    with pytest.raises(ValueError):
        Want.loads(json.dumps(data))


@pytest.mark.parametrize(
    "change",
    [
        {"rank": 2},  # outside a group of 2
        {"world": 1},
        {"timeout_s": 0},
        {"timeout_s": True},
        {"backend": "mpi"},
        {"version": "3"},
        {"address": ""},
    ],
)
def test_a_bad_grant_is_refused(change: dict) -> None:
    with pytest.raises(ValueError):
        Grant.loads(_grant(**change))


@pytest.mark.parametrize(
    "raw", [b"[]", b"{}", json.dumps({"replica": "r", "nonce": "n", "version": -2}).encode()]
)
def test_a_bad_want_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        Want.loads(raw)
