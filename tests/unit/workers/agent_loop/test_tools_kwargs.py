"""verl's `extra_info.tools_kwargs`: each offered tool's `create_kwargs` reach its `create`."""

from __future__ import annotations

import pytest

from workers.agent_loop.exceptions import AgentLoopError
from workers.agent_loop.tool_agent import _create_kwargs

TOOLS = {"search": object(), "calc": object()}


def test_create_kwargs_of_offered_tools_are_passed_on() -> None:
    extra = {
        "tools_kwargs": {
            "search": {"create_kwargs": {"ground_truth": {"target": ["x"]}, "question": "q"}},
            "calc": {},
            "not_offered": {"create_kwargs": {"a": 1}},
        }
    }
    assert _create_kwargs(extra, TOOLS) == {
        "search": {"ground_truth": {"target": ["x"]}, "question": "q"},
        "calc": {},
    }
    assert _create_kwargs({}, TOOLS) == {}


@pytest.mark.parametrize(
    "given",
    [["search"], {"search": {"create_kwargs": ["x"]}}, {"search": "create"}],
)
def test_a_malformed_entry_ends_the_sample_with_its_reason(given: object) -> None:
    with pytest.raises(AgentLoopError, match="tools_kwargs") as caught:
        _create_kwargs({"tools_kwargs": given}, TOOLS)
    assert caught.value.cause == "tool_config"
