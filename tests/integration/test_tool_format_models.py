"""The proof per chat format: a tiny model that learned its family's tool calls, on a real
`hf` replica, through the real worker and broker.

Per family, the tiny model (`rollout model init --template FAMILY`) gets the supervised warm
start of `pipeline.harness.demo.tool_warm_start` (built once per family per session), then answers
arithmetic questions with the calculator. Its calls must be parsed (by the parser the worker
recognised from the template), executed and answered in at least 80% of the trajectories,
each tool block must be exactly what the template renders between the turns, and
`response_mask` must be 1 on the model's own tokens only.

Sampling is at temperature 0.7, with a seed: a model this small, after 150 steps, still puts
a few percent of its mass on broken JSON at temperature 1 (`python -m
pipeline.harness.demo.tool_warm_start` prints both rates); what is proven here is the format's path
through the pipeline, not the model.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pipeline.data.arithmetic import arithmetic_rows
from pipeline.harness.demo.tool_warm_start import ToolRecipe, question_messages, tool_warm_start
from pipeline.harness.models.templates import FAMILY_NAMES
from pipeline.harness.models.tiny import template_family
from schemas import PromptEvent
from tests.conftest import ReplicaProcess
from tests.integration.agent_helpers import (
    finals_by_sample,
    produce_prompts,
    read_turns,
    run_worker_until,
    trajectory,
)
from tests.integration.test_tool_formats import CALCULATOR, FORMATS
from workers.agent_loop.app import AgentLoopWorker
from workers.agent_loop.config import AgentLoopConfig, AgentLoopWorkerConfig
from workers.agent_loop.exceptions import ToolError
from workers.agent_loop.parsers import get_parser
from workers.agent_loop.tools import load_tools
from workers.agent_loop.tools.calculator import evaluate
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.llm.contract import SamplingParams

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.long]

PROMPTS = 16


@pytest.fixture(scope="session")
def warm_format_model(
    family_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """`warm_format_model(family)`: the family's tiny model after the tool warm start."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp("warm") / family
            shutil.copytree(family_model(family), out)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # a second thread only contends on a shared machine
            try:
                tool_warm_start(out, ToolRecipe())
            finally:
                torch.set_num_threads(threads)
            built[family] = out
        return built[family]

    return get


def _result_text(arguments: object) -> str:
    """What the calculator answers to a call's arguments (its error, if it refuses them)."""
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    try:
        value = evaluate(expression)  # type: ignore[arg-type]
    except ToolError:
        return "Error:"
    return str(int(value)) if float(value).is_integer() else repr(value)


@pytest.mark.parametrize("family", FAMILY_NAMES)
async def test_a_warm_started_model_calls_the_calculator_in_its_format(
    family: str,
    warm_format_model: Callable[[str], Path],
    kafka_config: KafkaConfig,
    topics_config: TopicsConfig,
    unique: Callable[[str], str],
    tmp_path: Path,
) -> None:
    model = warm_format_model(family)
    rows = arithmetic_rows(PROMPTS, seed=7, max_operand=9)
    produce_prompts(
        kafka_config,
        topics_config.name("prompts"),
        [
            PromptEvent(
                uid=f"q{i}",
                prompt=question_messages(row),
                data_source="openai/gsm8k",
                reward_model=row["reward_model"],
                agent_name="tool_agent",
            )
            for i, row in enumerate(rows)
        ],
    )
    replica = ReplicaProcess(model, f"hf-{family}", tmp_path)
    try:
        replica.wait_healthy()
        cfg = AgentLoopWorkerConfig(
            group_id=unique(family),
            model=str(model),
            n=1,
            replicas=[replica.address],
            sampling=SamplingParams(max_tokens=64, temperature=0.7, seed=0),
            loops=AgentLoopConfig(
                max_response_length=192,
                options={"max_assistant_turns": 2, "max_user_turns": 1},
            ),
        )
        worker = AgentLoopWorker(kafka_config, topics_config, cfg, tools=load_tools(CALCULATOR))
        await run_worker_until(
            worker, lambda: worker.counters["trajectories"] >= PROMPTS, timeout_s=300
        )
    finally:
        replica.stop()
    turns = read_turns(
        kafka_config,
        topics_config.name("turns"),
        until=lambda ts: len(finals_by_sample(ts)) >= PROMPTS,
    )
    finals = finals_by_sample(turns)
    assert len(finals) == PROMPTS and worker.counters["dead_letters"] == 0

    tok = AutoTokenizer.from_pretrained(model)
    parser = get_parser(template_family(family).parser)
    end_of_turn = template_family(family).eos
    _, _, block_form, _ = FORMATS[family]
    called = answered = 0
    for i, row in enumerate(rows):
        traj = trajectory(turns, f"q{i}", 0, finals[(f"q{i}", 0)][0])
        # Mask 1 exactly on what the replica generated (with its logprobs), 0 on the rest.
        for turn in traj:
            assert turn.loss_mask == (1 if turn.role == "assistant" else 0)
            if turn.role == "assistant":
                assert turn.logprobs is not None and len(turn.logprobs) == len(turn.token_ids)
                assert np.all(turn.logprobs <= 0)
            else:
                assert turn.logprobs is None
        first = tok.decode(traj[0].token_ids.tolist(), skip_special_tokens=False)
        _, calls = parser.parse(first)
        if not calls or any(c.error for c in calls):
            continue
        called += 1
        assert [t.role for t in traj[:2]] == ["assistant", "tool"]
        # The tool block: the template's text between the turns, the calculator's answers in it.
        block = tok.decode(traj[1].token_ids.tolist(), skip_special_tokens=False)
        results = [_result_text(c.arguments) for c in calls]
        if len(calls) == 1 and results[0] != "Error:":
            expected = block_form.replace("{result}", results[0])
            if first.endswith(end_of_turn):
                expected = expected.removeprefix(end_of_turn)
            assert block == expected, (first, block)
        for result in results:
            assert result in block
        last = tok.decode(traj[-1].token_ids.tolist(), skip_special_tokens=False)
        answered += f"#### {row['reward_model']['ground_truth']}" in last
    print(
        f"\n{family}: {called}/{PROMPTS} trajectories with parsed calls, "
        f"{answered}/{PROMPTS} right answers"
    )
    assert called >= 0.8 * PROMPTS
