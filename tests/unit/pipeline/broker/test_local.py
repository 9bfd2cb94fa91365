"""Pure parts of the local broker launcher."""

from __future__ import annotations

import base64
import re

from pipeline.broker.local import _cluster_id


def test_cluster_ids_are_kafka_uuids_that_never_start_with_a_dash() -> None:
    # A leading '-' made the storage tool read `-t -abc…` as a missing value; one random id
    # in 64 starts with it, so 4,000 draws would all but surely include one.
    ids = [_cluster_id() for _ in range(4000)]
    assert not [i for i in ids if i.startswith("-")]
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", i) for i in ids)
    assert len(base64.urlsafe_b64decode(ids[0] + "==")) == 16
    assert len(set(ids)) == len(ids)
