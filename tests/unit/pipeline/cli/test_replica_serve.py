"""`rollout replica serve`, the one command line of every replica backend: its flags become
the chosen backend's own `serve` options (that backend's only), under the names it takes."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from pipeline.cli.main import build_parser
from pipeline.cli.stages import _backend_options
from pipeline.config import RunConfig
from workers.llm.engines.hf import server as hf
from workers.llm.engines.sglang.config import SGLangReplicaConfig, build_sglang_command
from workers.llm.engines.vllm.config import VLLMReplicaConfig, build_vllm_command

MOE_CONFIG = {"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts_per_tok": 2}


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
        "role": "policy",
        "await_weights": False,  # weights.mode=broadcast makes it True
        "dtype": "float32",  # --dtype bfloat16: it serves (and receives broadcasts) in bf16
    }
    serve = inspect.signature(hf.serve).parameters
    defaults = _options("--backend", "hf")
    assert {name: serve[name].default for name in defaults} == defaults


def test_the_hf_replica_serves_float32_or_bfloat16_and_says_so_in_one_line() -> None:
    from pipeline.config import ConfigError

    assert _options("--dtype", "bfloat16")["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="the hf replica serves float32 or bfloat16"):
        _options("--dtype", "float16")


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


def test_sglang_flags_are_replica_config_fields() -> None:
    options = _options(
        "--backend", "sglang",
        "--tp", "2",
        "--dtype", "bfloat16",
        "--internal-port", "9002",
        "--sglang-python", "/py",
        "--sglang-arg=--log-level=debug",
    )  # fmt: skip
    config = SGLangReplicaConfig(model="/m", port=8000, **options)
    assert (config.tp, config.internal_port, config.python) == (2, 9002, "/py")
    cmd = build_sglang_command(config, internal_port=9002)
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[-1] == "--log-level=debug"


@pytest.mark.parametrize(
    "argv", [("--max-batch", "0"), ("--prefix-cache-tokens", "-1"), ("--max-model-len", "8")]
)
def test_out_of_range_sizes_are_a_usage_line(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _options(*argv)
    assert exited.value.code == 2 and "must be >=" in capsys.readouterr().err


def test_routed_experts_is_a_vllm_option_for_a_moe_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.cli.main import main

    assert _options("--backend", "vllm", "--routed-experts")["return_routed_experts"] is True
    assert _options("--backend", "vllm")["return_routed_experts"] is False
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for path, config in ((dense, {"model_type": "qwen2"}), (moe, MOE_CONFIG)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    for backend, model, why in (
        ("hf", moe, "--routed-experts is a vllm option"),
        ("vllm", dense, "is no Mixture-of-Experts model"),
    ):
        argv = ["replica", "serve", "--backend", backend, "--model", str(model), "--routed-experts"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1, err


def test_a_moe_reward_model_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.cli.main import main

    argv = ["model", "init", "--preset", "moe", "--reward-model", "--out", str(tmp_path / "m")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "the moe preset is a causal LM only" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "m").exists()
