"""The sglang replica's configuration: the SGLang server command line and the interpreter gate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from workers.llm.engines.exceptions import BackendUnavailableError
from workers.llm.engines.sglang.config import (
    SGLangReplicaConfig,
    build_sglang_command,
    check_sglang_python,
    resolve_sglang_python,
)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_carries_what_the_adapter_relies_on(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = SGLangReplicaConfig(
        model=str(tmp_path), port=8100, tp=2, dp=3, initial_version=5, max_model_len=512
    )
    cmd = build_sglang_command(config, internal_port=9100, python="/py")
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    assert flag(cmd, "--model-path") == str(tmp_path) and flag(cmd, "--port") == "9100"
    assert (flag(cmd, "--tp-size"), flag(cmd, "--dp-size"), flag(cmd, "--pp-size")) == (
        "2",
        "3",
        "1",
    )
    assert flag(cmd, "--weight-version") == "5" and flag(cmd, "--context-length") == "512"
    assert flag(cmd, "--dtype") == "float32" and "--enable-metrics" in cmd
    assert flag(cmd, "--served-model-name") == tmp_path.name
    assert "--skip-tokenizer-init" not in cmd and "--disable-cuda-graph" not in cmd


def test_no_tokenizer_skips_its_init_and_eager_disables_graphs(tmp_path: Path) -> None:
    config = SGLangReplicaConfig(
        model=str(tmp_path), port=8100, enforce_eager=True, extra_args=("--log-level=debug",)
    )
    cmd = build_sglang_command(config, internal_port=9100, python="/py")
    assert "--skip-tokenizer-init" in cmd and "--disable-cuda-graph" in cmd
    assert cmd[-1] == "--log-level=debug"


@pytest.mark.parametrize("arg", ["--port=1", "--weight-version", "--tp-size=2", "--model-path"])
def test_flags_the_launcher_sets_cannot_be_passed_through(arg: str) -> None:
    with pytest.raises(ValidationError, match="set by the replica launcher"):
        SGLangReplicaConfig(model="m", port=8100, extra_args=(arg,))


def test_interpreter_is_the_configured_one_else_a_default() -> None:
    assert resolve_sglang_python("/opt/sglang/bin/python") == "/opt/sglang/bin/python"
    default = resolve_sglang_python(None)
    assert default.endswith(".venv-sglang/bin/python") or default == sys.executable


def test_gate_says_why_in_one_line() -> None:
    with pytest.raises(BackendUnavailableError, match="has no sglang module") as no_pkg:
        check_sglang_python(sys.executable)  # .venv has no sglang
    assert "\n" not in str(no_pkg.value)
    with pytest.raises(BackendUnavailableError, match="cannot run /nonexistent/python"):
        check_sglang_python("/nonexistent/python")
