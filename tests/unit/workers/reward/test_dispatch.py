"""Scorer dispatch: custom functions (sync, async, thread, process), the reward-model
client against a stub /classify server, rule routing, failures, and config checks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from pydantic import ValidationError

from schemas.events import ExtraFields
from workers.reward.assembler import Assembled
from workers.reward.config import RewardConfig
from workers.reward.dispatch import Dispatcher, Score, normalise_result
from workers.reward.exceptions import (
    RewardError,
    RewardModelError,
    ScorerError,
    ScorerTimeout,
    UnknownDataSource,
)
from workers.reward.pool import ScorerPool
from workers.reward.rm_client import RewardModelClient

MODULE = __name__


class CharTokenizer:
    """Token id = code point: enough to test decoding without a real tokenizer."""

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["".join(map(chr, seq)) for seq in ids]


def item(text: str, *, data_source: str = "openai/gsm8k", truth: str | None = "42") -> Assembled:
    ids = np.array([ord(c) for c in text], dtype="<i4")
    fields = {
        "uid": "u",
        "trajectory_id": "u/0",
        "sample_index": 0,
        "attempt_id": "a",
        "data_source": data_source,
        "prompt_ids": np.array([1, 2], dtype="<i4"),
        "response_ids": ids,
        "response_mask": np.ones(len(ids), dtype="u1"),
        "response_logprobs": np.zeros(len(ids), dtype="<f4"),
        "num_turns": 2,
        "tool_rewards": [],
        "turn_scores": [],
        "extra_fields": ExtraFields(min_global_steps=0, max_global_steps=0),
    }
    return Assembled(
        fields=fields, ground_truth=truth, extra_info={"x": 1}, data_source=data_source
    )


# --- custom functions (importable as tests.unit.workers.reward.test_dispatch) -------------------


def sync_reward(
    solution_str: str, ground_truth: str, data_source: str, extra_info: dict[str, Any]
) -> float:
    return 1.0 if ground_truth in solution_str else 0.0


async def async_reward(
    solution_str: str, ground_truth: str, trajectory: Any, **_: Any
) -> dict[str, Any]:
    await asyncio.sleep(0)
    n = len(trajectory["response_ids"])
    return {"score": 0.5, "length": n, "np": np.float32(2.0)}


def raising_reward(**_: Any) -> float:
    raise ZeroDivisionError("boom")


def slow_reward(**_: Any) -> float:
    time.sleep(3)
    return 1.0


def process_reward(solution_str: str, trajectory: dict[str, Any], **_: Any) -> dict[str, Any]:
    return {"score": float(len(solution_str)), "ids": len(trajectory["response_ids"])}


def config(**kw: Any) -> RewardConfig:
    return RewardConfig(tokenizer="unused", **kw)


def custom(name: str, **kw: Any) -> dict[str, Any]:
    return {"path": MODULE, "name": name, **kw}


async def test_sync_custom_in_thread() -> None:
    d = Dispatcher(config(custom=custom("sync_reward")), tokenizer=CharTokenizer(), pool=None)
    out = await d.score_batch([item("it is 42"), item("it is 41")])
    assert [o.value for o in out if isinstance(o, Score)] == [1.0, 0.0]


async def test_async_custom_gets_the_trajectory_and_extras() -> None:
    d = Dispatcher(config(custom=custom("async_reward")), tokenizer=CharTokenizer(), pool=None)
    [out] = await d.score_batch([item("abc")])
    assert isinstance(out, Score)
    assert out.value == 0.5 and out.extra["length"] == 3 and out.extra["np"] == 2.0
    assert type(out.extra["np"]) is float and out.extra["scorer"] == "custom"


async def test_custom_failures_become_errors_not_exceptions() -> None:
    d = Dispatcher(config(custom=custom("raising_reward")), tokenizer=CharTokenizer(), pool=None)
    [out] = await d.score_batch([item("x")])
    assert isinstance(out, ScorerError) and out.error_class == "ZeroDivisionError"
    d = Dispatcher(
        config(custom=custom("slow_reward"), scorer_timeout_s=0.2),
        tokenizer=CharTokenizer(),
        pool=None,
    )
    [out] = await d.score_batch([item("x")])
    assert isinstance(out, ScorerTimeout)


async def test_custom_in_the_process_pool() -> None:
    cfg = config(custom=custom("process_reward", executor="process"))
    async with ScorerPool(1, preload=()) as pool:
        d = Dispatcher(cfg, tokenizer=CharTokenizer(), pool=pool)
        [out] = await d.score_batch([item("hello")])
    assert isinstance(out, Score) and out.value == 5.0 and out.extra["ids"] == 5


async def test_rule_routing_and_unknown_data_source() -> None:
    d = Dispatcher(config(), tokenizer=CharTokenizer(), pool=None)
    out = await d.score_batch(
        [
            item("#### 42"),
            item("#### 4"),
            item("#### 42", data_source="nope"),
            item("#### 1", truth=None),
        ]
    )
    assert isinstance(out[0], Score) and out[0].value == 1.0 and out[0].extra == {"scorer": "gsm8k"}
    assert isinstance(out[1], Score) and out[1].value == 0.0
    assert isinstance(out[2], UnknownDataSource) and out[2].cause == "unknown_data_source"
    assert isinstance(out[3], ScorerError)


def test_normalise_result() -> None:
    assert normalise_result(True).value == 1.0
    assert normalise_result(np.float64(0.25)).value == 0.25
    with pytest.raises(ScorerError):
        normalise_result({"acc": 1})
    with pytest.raises(ScorerError):
        normalise_result("1.0")


# --- reward model ----------------------------------------------------------------------


async def _stub_rm(fail: bool = False) -> tuple[web.AppRunner, str]:
    async def classify(request: web.Request) -> web.Response:
        body = await request.json()
        if fail:
            return web.json_response({"error": "down"}, status=503)
        return web.json_response(
            {"scores": [sum(ids) / 100 for ids in body["input_ids"]], "policy_version": 7}
        )

    app = web.Application()
    app.router.add_post("/classify", classify)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_discriminative_reward_model() -> None:
    runner, url = await _stub_rm()
    try:
        cfg = RewardConfig(reward_model={"enable": True, "addresses": [url], "max_batch": 1})
        client = RewardModelClient([url], timeout_s=5, max_batch=1)
        d = Dispatcher(cfg, tokenizer=None, pool=None, reward_model=client)
        out = await d.score_batch([item("\x05"), item("\x0a")])
        await d.close()
    finally:
        await runner.cleanup()
    assert [o.value for o in out if isinstance(o, Score)] == [0.08, 0.13]  # prompt 1+2 + response
    assert isinstance(out[0], Score) and out[0].extra == {"scorer": "reward_model", "rm_version": 7}


async def test_reward_model_failure_fails_every_item() -> None:
    runner, url = await _stub_rm(fail=True)
    try:
        client = RewardModelClient([url, url], timeout_s=5, max_batch=8)
        cfg = RewardConfig(reward_model={"enable": True, "addresses": [url]})
        d = Dispatcher(cfg, tokenizer=None, pool=None, reward_model=client)
        out = await d.score_batch([item("a"), item("b")])
        await d.close()
    finally:
        await runner.cleanup()
    assert all(isinstance(o, RewardModelError) for o in out)


# --- config ----------------------------------------------------------------------------


def test_generative_reward_model_without_custom_is_rejected_at_start() -> None:
    with pytest.raises(ValidationError, match=r"generative.*custom reward function"):
        RewardConfig(tokenizer="t", reward_model={"enable": True, "style": "generative"})
    ok = RewardConfig(
        tokenizer="t",
        reward_model={"enable": True, "style": "generative"},
        custom=custom("sync_reward"),
    )
    assert ok.scorer_kind == "custom"


def test_dispatch_order_and_start_checks() -> None:
    assert RewardConfig().scorer_kind == "rule"
    assert RewardConfig().missing_for_start() is not None  # a rule scorer needs a tokenizer
    rm = RewardConfig(reward_model={"enable": True, "addresses": ["http://h:1"]})
    assert rm.scorer_kind == "reward_model" and rm.missing_for_start() is None
    with pytest.raises(ValidationError):
        RewardConfig(reward_model={"enable": True})  # no addresses
    with pytest.raises(ValidationError):
        RewardConfig(batch_size=0)


def test_custom_that_does_not_import_fails_at_start() -> None:
    with pytest.raises(RewardError, match="cannot load"):
        Dispatcher(config(custom={"path": MODULE, "name": "missing"}), tokenizer=None, pool=None)


def test_config_imports_light() -> None:
    code = (
        "import sys, workers.reward, workers.reward.config;"
        "print(','.join(m for m in ('torch', 'transformers', 'aiokafka', 'kafka', 'math_verify')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_decode_tail_ends_like_the_whole_decode_with_a_real_byte_level_tokenizer() -> None:
    from pipeline.harness.models.tiny import build_tokenizer
    from workers.reward.dispatch import decode_tail

    tok = build_tokenizer()
    rng = np.random.default_rng(7)
    texts = [
        "",
        "#### 42",
        "short answer #### 7",
        "é日本語 " * 300 + "#### -1,234.5",
        " ".join(str(rng.integers(0, 10**6)) for _ in range(900)) + " #### 12",
    ]
    arrays = [np.array(tok.encode(t), dtype="<i4") for t in texts]
    arrays.append(rng.integers(0, len(tok), 3000).astype("<i4"))  # any ids, split UTF-8 too
    whole = tok.batch_decode([a.tolist() for a in arrays], skip_special_tokens=True)
    tails = decode_tail(tok, arrays, 300)
    for full, tail in zip(whole, tails, strict=True):
        assert tail[-300:] == full[-300:]
        assert len(tail) <= len(full) + 1


async def test_gsm8k_items_are_scored_from_the_decoded_tail() -> None:
    long_wrong_then_right = "#### 41 " + "x" * 5000 + " #### 42"
    d = Dispatcher(
        RewardConfig(tokenizer="t", data_sources={"openai/gsm8k": "gsm8k"}),
        tokenizer=CharTokenizer(),
        pool=None,
    )
    (score,) = await d.score_batch([item(long_wrong_then_right)])
    assert isinstance(score, Score) and score.value == 1.0


def test_the_fast_detokenizer_decodes_like_transformers(tmp_path) -> None:
    from pipeline.harness.models.tiny import build_tokenizer
    from workers.reward.main import FastDetokenizer, load_tokenizer

    reference = build_tokenizer()
    reference.save_pretrained(tmp_path)
    fast = load_tokenizer(str(tmp_path))
    assert isinstance(fast, FastDetokenizer)
    rng = np.random.default_rng(3)
    special = list(reference.all_special_ids)
    ids = [[*rng.integers(0, len(reference), 200).tolist(), *special] for _ in range(5)]
    for skip in (True, False):
        assert fast.batch_decode(ids, skip_special_tokens=skip) == reference.batch_decode(
            ids, skip_special_tokens=skip
        )
    with pytest.raises(RewardError, match="cannot load the tokenizer"):
        (tmp_path / "tokenizer.json").write_text("{not json")
        load_tokenizer(str(tmp_path))
