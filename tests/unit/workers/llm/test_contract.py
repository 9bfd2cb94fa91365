"""`UpdateWeightsRequest`: a checkpoint path or the trainer's grant, exactly one."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.llm.contract import UpdateWeightsRequest


def test_a_path_or_a_grant() -> None:
    assert UpdateWeightsRequest(path="/ckpt/step-1", version=1).transfer is None
    assert UpdateWeightsRequest(version=2, transfer={"version": 2}).path == ""


@pytest.mark.parametrize("body", [{"version": 1}, {"version": 1, "path": "/c", "transfer": {}}])
def test_neither_or_both_is_refused(body: dict) -> None:
    with pytest.raises(ValidationError, match="exactly one of path and transfer"):
        UpdateWeightsRequest.model_validate(body)
