"""The vllm backend's pure parts: request/response mapping, metrics, launcher command line.

Fixtures follow the JSON vLLM's OpenAI server produces, read from vLLM's source:
- request fields: vllm/entrypoints/openai/completion/protocol.py (`CompletionRequest`);
- response: vllm/entrypoints/openai/completion/serving.py
  (`request_output_to_completion_response`, `_create_completion_logprobs`): one choice per
  prompt, `token_ids` / `prompt_token_ids` with `return_token_ids`, `logprobs.tokens` as
  "token_id:<id>" with `return_tokens_as_token_ids`, `finish_reason` "stop"|"length"|"abort";
- metrics: vllm/v1/metrics/loggers.py (`PrometheusStatLogger`), counters exposed with `_total`,
  labels `model_name` and `engine`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from tests import ROOT
from workers.llm.contract import CompletionRequest
from workers.llm.engines.gate import dropped_response
from workers.llm.engines.vllm.config import (
    VLLMReplicaConfig,
    build_vllm_command,
    build_vllm_env,
    cpu_kv_cache_gib,
    has_tokenizer,
    resolve_vllm_python,
)
from workers.llm.engines.vllm.mapping import (
    VLLMMetrics,
    VLLMUpstreamError,
    capacity_from_server_info,
    engine_request_id,
    from_vllm_completion,
    map_vllm_error,
    parse_vllm_metrics,
    to_vllm_completion,
)
from workers.metrics import render_replica_metrics


def vllm_response(
    token_ids: list[int] | None,
    logprobs: list[float | None] | None,
    finish_reason: str | None = "length",
    stop_reason: int | str | None = None,
    *,
    tokens_as_ids: bool = True,
) -> dict:
    """A non-streaming `/v1/completions` body as vLLM's serving.py builds it."""
    n = len(token_ids or logprobs or [])
    ids = token_ids or [0] * n
    lp = None
    if logprobs is not None:
        toks = [f"token_id:{t}" if tokens_as_ids else "x" for t in ids]
        lp = {
            "text_offset": list(range(n)),
            "token_logprobs": logprobs,
            "tokens": toks,
            "top_logprobs": [{t: v} for t, v in zip(toks, logprobs, strict=False)],
        }
    choice = {
        "index": 0,
        "text": "",
        "logprobs": lp,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_logprobs": None,
        "prompt_token_ids": [5, 6, 7],
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": "cmpl-abc-1234",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [choice],
        "usage": {
            "prompt_tokens": 3,
            "total_tokens": 3 + n,
            "completion_tokens": n,
            "prompt_tokens_details": None,
        },
        "system_fingerprint": None,
        "kv_transfer_params": None,
    }


# ------------------------------------------------------------------ request


def test_request_maps_to_token_prompt_with_ids_and_sampled_logprob() -> None:
    req = CompletionRequest(
        prompt=[5, 6, 7],
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=3,
        stop_token_ids=[2, 4],
        ignore_eos=True,
        request_id="traj-1",
    )
    body = to_vllm_completion(req, model="tiny", upstream_id="traj-1-ab12")
    assert body["prompt"] == [5, 6, 7]
    assert body["model"] == "tiny"
    assert body["request_id"] == "traj-1-ab12"
    assert body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 0  # the sampled token's logprob only
    assert body["stop_token_ids"] == [2, 4]
    assert body["ignore_eos"] is True
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"]) == (
        9,
        0.7,
        0.9,
        20,
    )
    assert body["seed"] == 3
    assert body["stream"] is False and body["n"] == 1 and body["echo"] is False
    # generation_config.json defaults must not leak in: neutral values are explicit.
    assert body["repetition_penalty"] == 1.0 and body["min_p"] == 0.0
    assert body["presence_penalty"] == 0.0 and body["frequency_penalty"] == 0.0


def test_request_without_logprobs_or_seed_omits_them() -> None:
    body = to_vllm_completion(
        CompletionRequest(prompt=[1], logprobs=None), model="m", upstream_id="req-1"
    )
    assert "logprobs" not in body and "seed" not in body
    assert body["top_k"] == -1  # vLLM accepts -1 as "disabled"


def test_engine_request_id_is_what_vllm_names_a_one_prompt_completion() -> None:
    # serving.py: request_id = f"cmpl-{base}", each prompt f"{request_id}-{i}"
    assert engine_request_id("traj-7/0-deadbeef") == "cmpl-traj-7/0-deadbeef-0"


# ------------------------------------------------------------------ response


def test_length_response_maps_tokens_logprobs_and_version() -> None:
    body = vllm_response([11, 12, 13], [-0.5, -1.25, -9999.0])
    resp = from_vllm_completion(body, policy_version=4, want_logprobs=True, request_id="traj-1")
    (choice,) = resp.choices
    assert choice.token_ids == [11, 12, 13]
    assert choice.logprobs == {"token_logprobs": [-0.5, -1.25, -9999.0]}
    assert choice.finish_reason == "length" and choice.stop_reason is None
    assert resp.policy_version == 4 and resp.id == "traj-1"
    assert resp.usage == {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}


def test_stop_token_is_reported_as_stop_reason() -> None:
    resp = from_vllm_completion(
        vllm_response([11, 2], [-0.1, -0.2], "stop", 2), policy_version=0, want_logprobs=True
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].stop_reason == 2
    assert resp.id == "cmpl-abc-1234"  # vLLM's id when the caller gave none


def test_stop_string_and_eos_have_no_stop_token() -> None:
    for reason in ("</answer>", None):
        resp = from_vllm_completion(
            vllm_response([11], [-0.1], "stop", reason), policy_version=0, want_logprobs=True
        )
        assert resp.choices[0].stop_reason is None


def test_aborted_request_keeps_its_partial_tokens() -> None:
    # v1 OutputProcessor.abort_requests emits a final output with FinishReason.ABORT.
    resp = from_vllm_completion(
        vllm_response([9, 9], [-1.0, -2.0], "abort"), policy_version=1, want_logprobs=True
    )
    assert resp.choices[0].finish_reason == "abort"
    assert resp.choices[0].token_ids == [9, 9]


def test_token_ids_recovered_from_token_id_strings_on_older_vllm() -> None:
    resp = from_vllm_completion(
        vllm_response(None, [-0.1, -0.2]), policy_version=0, want_logprobs=True
    )
    assert resp.choices[0].token_ids == [0, 0]
    body = vllm_response(None, [-0.1], tokens_as_ids=False)
    with pytest.raises(VLLMUpstreamError, match="token_ids"):
        from_vllm_completion(body, policy_version=0, want_logprobs=True)


def test_missing_logprob_becomes_the_floor() -> None:
    resp = from_vllm_completion(
        vllm_response([3, 4], [None, float("-inf")]), policy_version=0, want_logprobs=True
    )
    assert resp.choices[0].logprobs == {"token_logprobs": [-9999.0, -9999.0]}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (vllm_response([1, 2], None), "no logprobs"),
        (vllm_response([1, 2], [-0.1]), "do not match"),
        (vllm_response([1], [-0.1], "error"), "finish_reason"),
        ({"choices": []}, "0 choices"),
    ],
)
def test_responses_outside_the_contract_are_errors(body: dict, match: str) -> None:
    with pytest.raises(VLLMUpstreamError, match=match):
        from_vllm_completion(body, policy_version=0, want_logprobs=True)


def test_logprobs_dropped_when_not_requested() -> None:
    resp = from_vllm_completion(vllm_response([1], None), policy_version=0, want_logprobs=False)
    assert resp.choices[0].logprobs is None


def test_aborted_response_without_tokens() -> None:
    resp = dropped_response(
        request_id="r", model="m", created=1, policy_version=2, want_logprobs=True
    )
    choice = resp.choices[0]
    assert (choice.token_ids, choice.finish_reason, resp.policy_version) == ([], "abort", 2)
    assert choice.logprobs == {"token_logprobs": []}


def test_errors_in_both_vllm_shapes_map_to_the_contract_shape() -> None:
    new = {"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}}
    old = {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}
    for body in (new, old):
        assert map_vllm_error(400, body) == {
            "error": {"message": "too long", "type": "BadRequestError"}
        }
    assert map_vllm_error(500, "boom") == {"error": {"message": "boom", "type": "internal_error"}}
    assert map_vllm_error(422, {"detail": "bad"})["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ metrics

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 360.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 1234.0
vllm:generation_tokens_total{engine="1",model_name="tiny"} 766.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 0.0
"""


def test_vllm_metrics_are_summed_over_engines() -> None:
    m = parse_vllm_metrics(VLLM_METRICS)
    assert m == VLLMMetrics(
        running=5.0,
        waiting=1.0,
        generated_tokens=2000.0,
        prefix_cache_queries=1000.0,
        prefix_cache_hits=512.0,
    )


def test_older_gpu_prefix_cache_names_and_absent_series() -> None:
    text = (
        "# TYPE vllm:gpu_prefix_cache_queries_total counter\n"
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0\n'
        "# TYPE vllm:gpu_prefix_cache_hits_total counter\n"
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 4.0\n'
    )
    m = parse_vllm_metrics(text)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.running) == (10.0, 4.0, 0.0)


def test_contract_metrics_text() -> None:
    text = render_replica_metrics(
        parse_vllm_metrics(VLLM_METRICS), replica_id="gpu0:8000", policy_version=7
    ).decode()
    samples = {
        s.name: s
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }
    expected = {
        "rollout_replica_running_requests": 5.0,
        "rollout_replica_waiting_requests": 1.0,
        "rollout_replica_generated_tokens_total": 2000.0,
        "rollout_replica_prefix_cache_queries_total": 1000.0,
        "rollout_replica_prefix_cache_hits_total": 512.0,
        "rollout_replica_policy_version": 7.0,
        "rollout_replica_in_flight": 6.0,
        "rollout_replica_load": 6.0,
        "rollout_replica_prefix_cache_hit_rate": 0.512,
    }
    assert {k: s.value for k, s in samples.items()} == expected
    assert all(s.labels == {"replica": "gpu0:8000"} for s in samples.values())


def test_capacity_is_max_num_seqs_times_data_parallel_ranks() -> None:
    def info(seqs: object, dp: object = 1) -> dict[str, object]:
        config = {
            "scheduler_config": {"max_num_seqs": seqs},
            "parallel_config": {"data_parallel_size": dp},
        }
        return {"vllm_config": config}

    assert capacity_from_server_info(info(128)) == 128
    assert capacity_from_server_info(info(16, 4)) == 64
    assert (
        capacity_from_server_info({"vllm_config": {"scheduler_config": {"max_num_seqs": 8}}}) == 8
    )
    for bad in (None, "text", {}, {"vllm_config": "a string"}, info(None), info(0), info(8, "2")):
        assert capacity_from_server_info(bad) is None


# ------------------------------------------------------------------ launcher


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_line_for_tp_dp_pp(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = VLLMReplicaConfig(
        model=str(tmp_path),
        port=9000,
        tp=2,
        dp=4,
        pp=2,
        seed=7,
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        served_model_name="tiny",
        extra_args=("--kv-cache-dtype", "fp8"),
    )
    cmd = build_vllm_command(cfg, internal_port=12345, python="/py")
    assert cmd[:5] == ["/py", "-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    assert _flag(cmd, "--tensor-parallel-size") == "2"
    assert _flag(cmd, "--data-parallel-size") == "4"
    assert _flag(cmd, "--pipeline-parallel-size") == "2"
    assert cfg.world_size == 16
    assert (_flag(cmd, "--host"), _flag(cmd, "--port")) == ("127.0.0.1", "12345")
    assert _flag(cmd, "--served-model-name") == "tiny"
    assert _flag(cmd, "--seed") == "7"
    assert _flag(cmd, "--max-model-len") == "2048"
    assert _flag(cmd, "--gpu-memory-utilization") == "0.3"
    assert _flag(cmd, "--max-logprobs") == "1"
    assert "--enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert "--skip-tokenizer-init" not in cmd
    assert _flag(cmd, "--worker-extension-cls") == "workers.weights.vllm_worker.WeightSync"
    assert _flag(cmd, "--logprobs-mode") == "processed_logprobs"
    # DP 4: one API server, so an abort reaches the server that holds the request
    assert _flag(cmd, "--api-server-count") == "1"
    assert cmd[-2:] == ["--kv-cache-dtype", "fp8"]


def test_defaults_and_tokenizerless_model(tmp_path: Path) -> None:
    cfg = VLLMReplicaConfig(model=str(tmp_path / "ckpt"), port=9000)
    (tmp_path / "ckpt").mkdir()
    assert not has_tokenizer(tmp_path / "ckpt")
    cmd = build_vllm_command(cfg, internal_port=1)
    assert "--skip-tokenizer-init" in cmd
    assert "--max-model-len" not in cmd and "--gpu-memory-utilization" not in cmd
    assert "--enforce-eager" not in cmd
    assert "--api-server-count" not in cmd  # DP 1: vLLM's one server anyway
    assert _flag(cmd, "--served-model-name") == "ckpt"
    assert cfg.world_size == 1 and cfg.resolved_replica_id().endswith(":9000")


def test_dev_mode_and_the_checkout_on_the_path() -> None:
    root = str(ROOT)
    env = build_vllm_env({"PATH": "/bin"})
    kv = str(cpu_kv_cache_gib())
    assert env == {
        "PATH": "/bin",
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": root,
        "VLLM_CPU_KVCACHE_SPACE": kv,
        "NCCL_CUMEM_ENABLE": "0",  # what a trainer's NCCL weight transfer shares with vLLM
    }
    env = build_vllm_env({"PYTHONPATH": f"/x:{root}", "VLLM_CPU_KVCACHE_SPACE": "3"})
    assert env["PYTHONPATH"] == f"{root}:/x" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_a_cpu_kv_cache_fits_the_host_unless_told() -> None:
    gib = 1 << 30
    assert [cpu_kv_cache_gib(n * gib) for n in (4, 24, 32, 64, 512)] == [1, 1, 2, 4, 8]


def test_the_root_cause_of_a_failed_start_is_one_line() -> None:
    from workers.llm.engines.child_output import root_cause

    lines = [
        "(EngineCore_DP0 pid=7) ERROR 12-02 04:17:27 [core.py:700] EngineCore failed to start.",
        "(EngineCore_DP0 pid=7) ERROR 12-02 04:17:27 [core.py:700] Traceback (most recent call",
        '(EngineCore_DP0 pid=7) ERROR 12-02 04:17:27 [core.py:700]   File "x.py", line 3, in f',
        "(EngineCore_DP0 pid=7) ERROR 12-02 04:17:27 [core.py:700] ValueError: KV cache: 22 GiB",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed: {}",
    ]
    assert root_cause(lines) == "ValueError: KV cache: 22 GiB"
    assert root_cause(["RuntimeError: Engine core initialization failed."]) == (
        "RuntimeError: Engine core initialization failed."
    )
    assert root_cause(["INFO 12-02 04:17:27 [api.py:1] started", "no exception"]) is None


def test_the_vllm_interpreter_is_configured_else_vllm_venv_else_this_one(tmp_path: Path) -> None:
    assert resolve_vllm_python("/opt/vllm/bin/python") == "/opt/vllm/bin/python"
    cfg = VLLMReplicaConfig(model=str(tmp_path), port=1, python="/opt/py")
    assert build_vllm_command(cfg, internal_port=2)[0] == "/opt/py"
    venv = ROOT / ".venv-vllm" / "bin" / "python"
    assert resolve_vllm_python(None) == (str(venv) if venv.is_file() else sys.executable)


def test_the_worker_extension_imports_without_the_project_dependencies() -> None:
    """vLLM's workers import it in vLLM's venv, which has no orjson, kafka or schemas deps."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'orjson', 'kafka', 'schemas', 'pydantic', 'aiohttp'}:\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import workers.weights.vllm_worker as m\n"
        "print(m.WeightSync.rollout_load_weights.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rollout_load_weights"


@pytest.mark.parametrize(
    "arg",
    [
        "--port",
        "--tensor-parallel-size=2",
        "-tp",
        "--served-model-name",
        "--logprobs-mode=raw_logprobs",
        "--worker-extension-cls",
    ],
)
def test_managed_flags_cannot_be_overridden(arg: str) -> None:
    with pytest.raises(ValidationError, match="set by the replica launcher"):
        VLLMReplicaConfig(model="m", port=1, extra_args=(arg, "2"))


def test_importing_the_backend_does_not_import_vllm_or_torch() -> None:
    code = (
        "import sys, workers.llm.engines.vllm.server;"
        "bad = [n for n in ('vllm', 'torch') if n in sys.modules]; sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()


# ------------------------------------------------------------------ routed experts


def _npy_base64(array: object, *, objects: bool = False) -> str:
    """What vLLM's `numpy2base64` sends: base64 of `np.save(..., allow_pickle=False)`
    (`objects`: an object array, which only a pickling writer can make)."""
    import io

    import numpy as np
    import pybase64

    with io.BytesIO() as buf:
        np.save(buf, array, allow_pickle=objects)
        return pybase64.b64encode(buf.getvalue()).decode("ascii")


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_routed_experts_map_from_vllms_npy_base64(dtype: str) -> None:
    import numpy as np

    from workers.llm.engines.vllm.mapping import routed_experts_from_vllm

    rows = np.arange(5 * 4 * 2).reshape(5, 4, 2).astype(dtype) % 8
    body = vllm_response([1, 2, 3], [-0.5] * 3)
    body["choices"][0]["routed_experts"] = _npy_base64(rows)
    resp = from_vllm_completion(body, policy_version=2, want_logprobs=True, num_experts=8)
    routed = resp.choices[0].routed_experts
    assert routed is not None and routed.num_experts == 8
    assert routed.as_array().tolist() == rows.tolist() and routed.experts.dtype == np.uint8
    # Not asked (no num_experts): vLLM's routing, sent for every request, is dropped.
    plain = from_vllm_completion(body, policy_version=2, want_logprobs=True)
    assert plain.choices[0].routed_experts is None
    assert routed_experts_from_vllm(_npy_base64(rows), 300).experts.dtype == np.dtype("<i2")


def test_routed_experts_outside_the_contract_are_upstream_errors() -> None:
    import numpy as np

    from workers.llm.engines.vllm.mapping import routed_experts_from_vllm

    with pytest.raises(VLLMUpstreamError, match=r"not a \.npy"):
        routed_experts_from_vllm("bm90IG5weQ==", 8)  # base64 of "not npy"
    objects = _npy_base64(np.array([{"a": 1}], dtype=object), objects=True)
    with pytest.raises(VLLMUpstreamError, match=r"not a \.npy.*allow_pickle"):  # never unpickled
        routed_experts_from_vllm(objects, 8)
    with pytest.raises(VLLMUpstreamError, match=r"shape \(3, 4\)"):
        routed_experts_from_vllm(_npy_base64(np.zeros((3, 4), dtype=np.uint8)), 8)
    with pytest.raises(VLLMUpstreamError, match="do not fit the model"):
        routed_experts_from_vllm(_npy_base64(np.full((2, 4, 2), 9, dtype=np.uint8)), 8)
    body = vllm_response([1, 2], [-0.5] * 2)  # asked for, tokens, no routing: the flag is off
    with pytest.raises(VLLMUpstreamError, match="no routed_experts"):
        from_vllm_completion(body, policy_version=0, want_logprobs=True, num_experts=8)
    aborted = vllm_response([], [], finish_reason="abort")  # aborted before any forward pass
    resp = from_vllm_completion(aborted, policy_version=0, want_logprobs=True, num_experts=8)
    assert resp.choices[0].routed_experts is None


def test_routed_experts_start_vllm_with_its_flag_and_model_runner_v2(tmp_path: Path) -> None:
    cfg = VLLMReplicaConfig(model=str(tmp_path), port=1, return_routed_experts=True)
    assert "--enable-return-routed-experts" in build_vllm_command(cfg, internal_port=2)
    plain = VLLMReplicaConfig(model=str(tmp_path), port=1)
    assert "--enable-return-routed-experts" not in build_vllm_command(plain, internal_port=2)
    assert build_vllm_env({}, routed_experts=True)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in build_vllm_env({})
    with pytest.raises(ValidationError, match="set by the replica launcher"):
        VLLMReplicaConfig(model="m", port=1, extra_args=("--enable-return-routed-experts",))


def test_a_pydantic_config_error_names_its_message_on_the_one_line() -> None:
    """What vLLM 0.32's CPU build prints for `--enable-return-routed-experts`."""
    from workers.llm.engines.child_output import root_cause

    lines = [
        "(APIServer pid=9) Traceback (most recent call last):",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig",
        "  Value error, Model Runner V2 requires Triton. [type=value_error, input_value=Args",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ]
    assert root_cause(lines) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig: "
        "Model Runner V2 requires Triton."
    )


def test_an_image_request_maps_to_the_token_in_generate_route(tmp_path: Path) -> None:
    from workers.llm.engines.vllm.config import takes_images
    from workers.llm.engines.vllm.mapping import (
        generate_as_completion,
        generate_engine_id,
        to_vllm_generate,
    )

    ref = {"sha256": "ab" * 32, "mime_type": "image/png", "size": 3, "data": "AAEC"}
    req = CompletionRequest(
        prompt=[1, 1024, 1024, 2], max_tokens=4, logprobs=0, seed=3, images=[ref]
    )
    body = to_vllm_generate(req, model="vl", upstream_id="u-1")
    assert body["token_ids"] == [1, 1024, 1024, 2] and body["output_mode"] == "tokens"
    assert body["content_parts"] == [
        {"type": "image_url", "url": "data:image/png;base64,AAEC", "uuid": "ab" * 32}
    ]
    params = body["sampling_params"]
    assert (params["max_tokens"], params["logprobs"], params["seed"]) == (4, 0, 3)
    assert generate_engine_id("u-1") == "generate-tokens-u-1"
    answer = {
        "request_id": "generate-tokens-u-1",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [7, 8],
                "logprobs": {"content": [{"token_id": 7, "logprob": -0.5},
                                         {"token_id": 8, "logprob": -1.5}]},
            }
        ],
    }  # fmt: skip
    resp = from_vllm_completion(
        generate_as_completion(answer), policy_version=2, want_logprobs=True, request_id="r"
    )
    assert resp.choices[0].token_ids == [7, 8]
    assert resp.choices[0].logprobs == {"token_logprobs": [-0.5, -1.5]}
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text('{"vision_config": {"model_type": "clip_vision_model"}}')
    assert takes_images(vl) and not takes_images(tmp_path / "absent")
    cmd = build_vllm_command(VLLMReplicaConfig(model=str(vl), port=8000), internal_port=8001)
    assert "--enable-scale-out" in cmd


def test_each_images_expanded_placeholders_go_to_vllm_as_one(tmp_path: Path) -> None:
    # vLLM expands a token-in prompt's placeholder itself; an expanded run sent as is would be
    # expanded again (4 -> 4 image features + 3 text embeddings), so the adapter cuts it back.
    from workers.llm.engines.vllm.config import image_token_id
    from workers.llm.engines.vllm.mapping import collapse_image_placeholders, to_vllm_generate

    img = 1024
    assert collapse_image_placeholders([1, img, img, img, img, 2], img, 1) == [1, img, 2]
    # Two images side by side are one run of 8: two placeholders, not one.
    assert collapse_image_placeholders([img] * 8 + [5], img, 2) == [img, img, 5]
    assert collapse_image_placeholders([img] * 4 + [5] + [img] * 4, img, 2) == [img, 5, img]
    with pytest.raises(ValueError, match="2 image\\(s\\) but 3 image placeholder"):
        collapse_image_placeholders([img, img, img], img, 2)
    with pytest.raises(ValueError, match="run of 1 image placeholder"):
        collapse_image_placeholders([img, 5, img, img, img], img, 2)
    with pytest.raises(ValueError, match="1 image\\(s\\) but 0"):
        collapse_image_placeholders([1, 2], img, 1)
    ref = {"sha256": "ab" * 32, "mime_type": "image/png", "size": 3, "data": "AAEC"}
    req = CompletionRequest(prompt=[1, img, img, 2], max_tokens=4, logprobs=0, images=[ref])
    body = to_vllm_generate(req, model="vl", upstream_id="u-1", image_token_id=img)
    assert body["token_ids"] == [1, img, 2]
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text('{"vision_config": {}, "image_token_index": 1024}')
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text('{"image_token_index": 7}')
    assert image_token_id(vl) == 1024
    assert image_token_id(text) is None and image_token_id(tmp_path / "absent") is None


def test_each_worker_files_its_report_under_its_index_across_engines(tmp_path: Path) -> None:
    """vLLM's /collective_rpc answers with engine 0's results only: each worker also files its
    report as `<dp x world + rank>.json`, so the adapter reads every engine's."""
    from types import SimpleNamespace

    from workers.weights.vllm_worker import _filed

    worker = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=1, world_size=2, rank=1)
    )
    report = {"reprocessed": [], "parameters": 3}
    assert _filed(worker, str(tmp_path), report) is report
    assert json.loads((tmp_path / "3.json").read_text()) == report
    assert [p.name for p in tmp_path.iterdir()] == ["3.json"]  # no half-written file left
    assert _filed(SimpleNamespace(), None, report) is report  # no directory: nothing filed
