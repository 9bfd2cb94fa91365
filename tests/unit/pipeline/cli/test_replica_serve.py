"""`rollout replica serve`, the one command line of every replica backend: its flags become
the chosen backend's own `serve` options (that backend's only), under the names it takes."""

from __future__ import annotations

import inspect

import pytest

from pipeline.cli.main import build_parser
from pipeline.cli.stages import _backend_options
from pipeline.config import RunConfig
from workers.llm.replicas import hf
from workers.llm.replicas.vllm_config import VLLMReplicaConfig, build_vllm_command


def _options(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["replica", "serve", "--model", "/m", *argv])
    return _backend_options(args, RunConfig())


def test_hf_flags_are_the_hf_serve_options_with_its_defaults() -> None:
    options = _options(
        "--threads", "1",
        "--max-batch", "3",
        "--prefix-cache-tokens", "0",
        "--max-model-len", "512",
        "--served-model-name", "tiny",
    )  # fmt: skip
    assert options == {
        "threads": 1,
        "max_batch": 3,
        "prefix_cache_tokens": 0,
        "max_model_len": 512,
        "served_model_name": "tiny",
    }
    serve = inspect.signature(hf.serve).parameters
    defaults = _options("--backend", "hf")
    assert {name: serve[name].default for name in defaults} == defaults


def test_vllm_flags_are_replica_config_fields() -> None:
    options = _options(
        "--backend", "vllm",
        "--tp", "2",
        "--dp", "2",
        "--dtype", "float32",
        "--internal-port", "9001",
        "--vllm-python", "/py",
        "--served-model-name", "tiny",
        "--max-model-len", "2048",
        "--vllm-arg=--enforce-eager",
        "--vllm-arg=-O0",
    )  # fmt: skip
    config = VLLMReplicaConfig(model="/m", port=8000, **options)
    assert (config.world_size, config.internal_port, config.dtype) == (4, 9001, "float32")
    cmd = build_vllm_command(config, internal_port=9001)
    assert cmd[0] == "/py" and cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert cmd[-2:] == ["--enforce-eager", "-O0"]


@pytest.mark.parametrize(
    "argv", [("--max-batch", "0"), ("--prefix-cache-tokens", "-1"), ("--max-model-len", "8")]
)
def test_out_of_range_sizes_are_a_usage_line(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _options(*argv)
    assert exited.value.code == 2 and "must be >=" in capsys.readouterr().err
