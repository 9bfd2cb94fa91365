"""The sglang backend's pure mappings, on SGLang's shapes as its source writes them.

The shapes below were read from SGLang 0.5.23 (python/sglang/srt/managers/tokenizer_manager.py
builds `{"text", "output_ids", "meta_info"}`, `detokenize_logprob_tokens` the
`[logprob, token_id, text]` triples, managers/schedule_batch.py the `FINISH_*.to_json()`
reasons, observability/metrics_collector.py the metric names); they are not recordings of a
running server, which this machine cannot start (README "SGLang"). `make sglang` also puts
the request bodies through the installed SGLang's own validators (marker `sglang`).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from workers.llm.contract import CompletionRequest
from workers.llm.engines.sglang.config import DEFAULT_SGLANG_VENV
from workers.llm.engines.sglang.mapping import (
    SGLangUpstreamError,
    capacity_from_server_info,
    from_sglang_generate,
    map_sglang_error,
    parse_sglang_metrics,
    to_sglang_generate,
    update_from_disk_body,
    upstream_rid,
)


def answer(ids: list[int], finish: dict[str, Any], *, logprobs: bool = True) -> dict[str, Any]:
    """A non-streamed `/generate` answer for `return_logprob=True` (BatchStrOutput path)."""
    meta: dict[str, Any] = {
        "id": "rid-1",
        "finish_reason": finish,
        "prompt_tokens": 3,
        "weight_version": "4",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
    }
    if logprobs:
        meta["output_token_logprobs"] = [[-0.25 * (i + 1), t, None] for i, t in enumerate(ids)]
    return {"text": "abc", "output_ids": ids, "meta_info": meta}


def mapped(body: dict[str, Any], *, want: bool = True, stops: list[int] | None = None) -> Any:
    return from_sglang_generate(
        body,
        policy_version=4,
        want_logprobs=want,
        request_id="c-1",
        model="tiny",
        created=7,
        stop_token_ids=stops or [],
    )


def test_request_is_sglangs_generate_body_with_neutral_penalties() -> None:
    req = CompletionRequest(
        prompt=[5, 6, 7], max_tokens=9, temperature=0.7, top_k=5, seed=11, stop_token_ids=[2]
    )
    body = to_sglang_generate(req, rid="r")
    assert body["rid"] == "r" and body["input_ids"] == [5, 6, 7] and body["stream"] is False
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"]) == (
        True,
        -1,
        0,
    )
    sampling = body["sampling_params"]
    assert sampling["max_new_tokens"] == 9 and sampling["temperature"] == 0.7
    assert sampling["top_k"] == 5 and sampling["sampling_seed"] == 11
    assert sampling["stop_token_ids"] == [2] and sampling["skip_special_tokens"] is False
    assert (sampling["repetition_penalty"], sampling["presence_penalty"]) == (1.0, 0.0)
    no_lp = to_sglang_generate(CompletionRequest(prompt=[1], logprobs=None), rid="r")
    assert "return_logprob" not in no_lp and "sampling_seed" not in no_lp["sampling_params"]


def test_rids_are_prefix_free_because_sglang_aborts_by_prefix() -> None:
    rids = [upstream_rid("x"), upstream_rid("x"), upstream_rid(None), upstream_rid("x-abc")]
    assert len(set(rids)) == 4
    assert not any(a != b and b.startswith(a) for a in rids for b in rids)


def test_length_answer_maps_tokens_logprobs_usage_and_version() -> None:
    resp = mapped(answer([4, 5, 6], {"type": "length", "length": 3}))
    (choice,) = resp.choices
    assert choice.token_ids == [4, 5, 6] and choice.finish_reason == "length"
    assert choice.logprobs == {"token_logprobs": [-0.25, -0.5, -0.75]}
    assert resp.policy_version == 4 and resp.id == "c-1" and resp.model == "tiny"
    assert resp.usage == {"completion_tokens": 3, "prompt_tokens": 3, "total_tokens": 6}
    assert (
        mapped(answer([4], {"type": "length", "length": 1}), want=False).choices[0].logprobs is None
    )


def test_stop_reports_only_a_requested_stop_token() -> None:
    # SGLang says `matched` for EOS too (FINISH_MATCHED_TOKEN); the contract names stop tokens.
    eos = mapped(answer([4, 2], {"type": "stop", "matched": 2}))
    assert eos.choices[0].finish_reason == "stop" and eos.choices[0].stop_reason is None
    named = mapped(answer([4, 9], {"type": "stop", "matched": 9}), stops=[9])
    assert named.choices[0].stop_reason == 9
    text = mapped(answer([4], {"type": "stop", "matched": "\n"}), stops=[9])
    assert text.choices[0].stop_reason is None


def test_user_abort_keeps_the_partial_tokens() -> None:
    finish = {"type": "abort", "message": None, "status_code": None, "err_type": None}
    resp = mapped(answer([1, 2], finish))
    assert resp.choices[0].finish_reason == "abort" and resp.choices[0].token_ids == [1, 2]
    assert len(resp.choices[0].logprobs["token_logprobs"]) == 2


@pytest.mark.parametrize(
    "body",
    [
        answer([1, 2], {"type": "length", "length": 2}) | {"meta_info": None},
        answer([1], {"type": "weird"}),
        answer([1], None),  # type: ignore[arg-type]
        {"text": "x"},
    ],
)
def test_answers_outside_the_shape_are_upstream_errors(body: dict[str, Any]) -> None:
    with pytest.raises(SGLangUpstreamError):
        mapped(body)


def test_logprobs_must_match_the_tokens() -> None:
    short = answer([1, 2], {"type": "length", "length": 2})
    short["meta_info"]["output_token_logprobs"] = [[-0.1, 1, None]]
    with pytest.raises(SGLangUpstreamError, match="do not match"):
        mapped(short)
    swapped = answer([1, 2], {"type": "length", "length": 2})
    swapped["meta_info"]["output_token_logprobs"] = [[-0.1, 2, None], [-0.1, 1, None]]
    with pytest.raises(SGLangUpstreamError, match="not for token"):
        mapped(swapped)
    missing = answer([1], {"type": "length", "length": 1})
    missing["meta_info"]["output_token_logprobs"] = [[None, 1, None]]
    assert mapped(missing).choices[0].logprobs == {"token_logprobs": [-9999.0]}


@pytest.mark.parametrize(
    ("status", "body", "message", "kind"),
    [
        (400, {"error": {"message": "input is longer than the context"}}, "longer", "invalid"),
        (400, {"error": "sampling_params.top_k: expected int"}, "expected int", "invalid"),
        (422, {"detail": [{"msg": "field required"}]}, "field required", "invalid"),
        (503, "", "SGLang answered 503", "internal"),
    ],
)
def test_errors_take_the_contract_shape(status: int, body: Any, message: str, kind: str) -> None:
    err = map_sglang_error(status, body)["error"]
    assert message in err["message"] and err["type"].startswith(kind)


def test_weight_update_body_labels_the_version_and_flushes_the_cache() -> None:
    assert update_from_disk_body("/ckpt/v5", 5) == {
        "model_path": "/ckpt/v5",
        "weight_version": "5",
        "flush_cache": True,
    }


SGLANG_METRICS = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="tiny",engine_type="unified",tp_rank="0"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="tiny",engine_type="unified",tp_rank="0"} 2.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="tiny",is_streaming="false"} 900.0
sglang:prompt_tokens_total{model_name="tiny",is_streaming="true"} 100.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="tiny",is_streaming="false"} 640.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="tiny",cache_source="device"} 384.0
sglang:cached_tokens_total{model_name="tiny",cache_source="host"} 16.0
"""


def test_metrics_sum_sglangs_series() -> None:
    m = parse_sglang_metrics(SGLANG_METRICS)
    assert (m.running, m.waiting, m.generated_tokens) == (3.0, 2.0, 640.0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1000.0, 400.0)
    assert parse_sglang_metrics("").running == 0.0


def test_capacity_sums_the_data_parallel_ranks() -> None:
    states = [{"effective_max_running_requests_per_dp": 48}] * 2
    assert capacity_from_server_info({"internal_states": states}) == 96
    assert capacity_from_server_info({"internal_states": []}) is None
    assert capacity_from_server_info({"internal_states": [{"x": 1}]}) is None
    assert capacity_from_server_info(None) is None


SGLANG_PYTHON = DEFAULT_SGLANG_VENV / "bin" / "python"
VALIDATE = """
import json, sys
from pydantic import TypeAdapter
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.managers import io_struct as io
from sglang.srt.sampling.sampling_params import SamplingParams

bodies = json.load(sys.stdin)
for body in bodies["generate"]:
    assert generate_contract_error(body) is None, generate_contract_error(body)
    req = io.GenerateReqInput(**body)
    req.normalize_batch_and_arguments()
    SamplingParams(**body["sampling_params"]).verify(vocab_size=1024)
for name, body in bodies["control"]:
    TypeAdapter(getattr(io, name)).validate_python(body)  # as FastAPI parses the endpoint's body
print("valid", len(bodies["generate"]), len(bodies["control"]))
"""


@pytest.mark.sglang
def test_bodies_pass_sglangs_own_validators() -> None:
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"{SGLANG_PYTHON} missing: build it with `make sglang`", pytrace=False)
    generate = [
        to_sglang_generate(CompletionRequest(prompt=[5, 6], seed=3, stop_token_ids=[2]), rid="a"),
        to_sglang_generate(CompletionRequest(prompt=[5], logprobs=None, temperature=0.0), rid="b"),
    ]
    control = [
        ("AbortReq", {"rid": upstream_rid("c")}),
        ("PauseGenerationReqInput", {"mode": "abort"}),
        ("ContinueGenerationReqInput", {}),
        ("UpdateWeightFromDiskReqInput", update_from_disk_body("/ckpt/v1", 1)),
    ]
    done = subprocess.run(
        [str(SGLANG_PYTHON), "-c", VALIDATE],
        input=json.dumps({"generate": generate, "control": control}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "valid 2 4"
