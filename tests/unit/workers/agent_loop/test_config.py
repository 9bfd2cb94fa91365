"""The agent-loop worker's config: the model's format settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.agent_loop.config import AgentLoopWorkerConfig


def test_format_settings_default_to_the_models_own() -> None:
    cfg = AgentLoopWorkerConfig()
    assert cfg.tool_parser is None  # recognised from the chat template at start
    assert cfg.chat_template_kwargs == {}
    assert "tool_parser" not in cfg.loops.options
    cfg = AgentLoopWorkerConfig(
        tool_parser="pkg.mod:MyParser", chat_template_kwargs={"enable_thinking": False}
    )
    assert cfg.tool_parser == "pkg.mod:MyParser"
    assert cfg.chat_template_kwargs == {"enable_thinking": False}


def test_the_old_place_of_the_parser_still_chooses_it() -> None:
    cfg = AgentLoopWorkerConfig(loops={"options": {"tool_parser": "mistral"}})
    assert cfg.tool_parser == "mistral" and "tool_parser" not in cfg.loops.options
    same = AgentLoopWorkerConfig(
        tool_parser="mistral", loops={"options": {"tool_parser": "mistral"}}
    )
    assert same.tool_parser == "mistral"
    with pytest.raises(ValidationError, match="set tool_parser only"):
        AgentLoopWorkerConfig(tool_parser="hermes", loops={"options": {"tool_parser": "mistral"}})
