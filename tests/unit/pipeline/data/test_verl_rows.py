"""Rows as verl's own preprocessors write them (examples/data_preprocess/*.py): every column
and type reaches the pipeline, or is refused or named — none vanishes.

The row shapes: gsm8k (ground truth a string, `extra_info.index` an int), MATH-lighteval (its
source's `level` and `type` kept by `datasets.map`), hellaswag (ground truth an int, extra
`reward_model` keys), Search-R1 (ground truth `{"target": [...]}`, `tools_kwargs` for the
search tool, a `metadata` column), DAPO-Math-17k (`extra_info.index` a UUID string), gsm8k
with the tool agent (`agent_name`, `tools_kwargs`, `interaction_kwargs`), geo3k (`images`:
made image parts; the images themselves are read at produce, tests/unit/workers/media).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.datasets import (
    RowError,
    dataset_uid_prefix,
    read_rows,
    row_to_prompt,
    unused_columns,
)
from pipeline.data.producer import ProduceReport

SYSTEM = {"role": "system", "content": "You are a helpful and harmless assistant."}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


GSM8K = {
    "data_source": "openai/gsm8k",
    "prompt": user("Natalia sold clips… Let's think step by step."),
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": "… #### 72", "question": "…"},
}
MATH = {
    "data_source": "DigitalLearningGmbH/MATH-lighteval",
    "prompt": user("What is $1+1$? Put the answer in \\boxed{}."),
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"split": "train", "index": 3},
    "level": "Level 1",
    "type": "Algebra",
}
HELLASWAG = {
    "data_source": "Rowan/hellaswag",
    "prompt": "A man is sitting on a roof. he",
    "ability": "nlp",
    "reward_model": {
        "style": "model",
        "eval": "multiple_choice",
        "ground_truth": 3,
        "choices": ["a", "b", "c", "starts pulling up roofing"],
    },
    "extra_info": {"split": "train", "index": 7},
}
SEARCH_R1 = {
    "data_source": "searchR1_nq",
    "prompt": [SYSTEM, {"role": "user", "content": "Question: who wrote hamlet?"}],
    "ability": "fact-reasoning",
    "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare", "W. S."]}},
    "extra_info": {
        "index": 11,
        "need_tools_kwargs": True,
        "question": "who wrote hamlet?",
        "split": "train",
        "tools_kwargs": {
            "search": {
                "create_kwargs": {
                    "ground_truth": {"target": ["Shakespeare", "W. S."]},
                    "question": "who wrote hamlet?",
                    "data_source": "searchR1_nq",
                }
            }
        },
    },
    "metadata": None,
}
DAPO = {
    "data_source": "math_dapo",
    "prompt": user("Solve … The last line of your response should be 'Answer: $Answer'."),
    "ability": "MATH",
    "reward_model": {"ground_truth": "-3", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}
GSM8K_TOOL_AGENT = {
    **GSM8K,
    "prompt": [SYSTEM, *GSM8K["prompt"]],
    "agent_name": "tool_agent",
    "extra_info": {
        **GSM8K["extra_info"],
        "need_tools_kwargs": True,
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
        "interaction_kwargs": {"query": "…", "ground_truth": "72"},
    },
}
GEO3K = {
    "data_source": "hiyouga/geometry3k",
    "prompt": user("<image>Find x. Put the answer in \\boxed{}."),
    "images": [{"bytes": b"\x89PNG\r\n\x1a\n", "path": None}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "3"},
    "extra_info": {"split": "train", "index": 0, "answer": "3", "question": "Find x."},
}

ACCEPTED = {
    "gsm8k": GSM8K,
    "math": MATH,
    "hellaswag": HELLASWAG,
    "search_r1": SEARCH_R1,
    "dapo": DAPO,
    "gsm8k_tool_agent": GSM8K_TOOL_AGENT,
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_every_read_column_reaches_the_prompt_with_its_type(name: str) -> None:
    row = ACCEPTED[name]
    event = row_to_prompt(row, 5, uid_prefix=name)
    assert event.uid == f"{name}-5"
    assert event.data_source == row["data_source"]
    assert event.reward_model.ground_truth == row["reward_model"]["ground_truth"]
    assert type(event.reward_model.ground_truth) is type(row["reward_model"]["ground_truth"])
    assert event.extra_info == row["extra_info"]  # tools_kwargs, a str or int index: whole
    assert event.ability == row.get("ability")
    assert event.agent_name == row.get("agent_name")
    spec = event.reward_model.model_dump()
    assert {k: spec[k] for k in row["reward_model"]} == row["reward_model"]  # choices, eval…


@pytest.mark.parametrize("truth", [4, 2.5, ["4", 4], {"target": ["a", "b"]}, "4"])
def test_ground_truth_of_any_json_type_survives_the_wire(truth: object) -> None:
    from schemas.codec import decode, encode

    event = row_to_prompt({**GSM8K, "reward_model": {"ground_truth": truth}}, 0, uid_prefix="g")
    assert decode(encode(event)).reward_model.ground_truth == truth


def test_columns_no_stage_reads_are_named_and_counted() -> None:
    assert unused_columns(MATH) == ["level", "type"]
    assert unused_columns(SEARCH_R1) == ["metadata"]
    assert unused_columns(GSM8K) == [] and unused_columns({**GSM8K, "images": []}) == []
    report = ProduceReport(sent=2)
    report.unused_columns.update(unused_columns(MATH) * 2)
    assert "columns no stage reads, not sent: level (2 rows), type (2 rows)" in report.summary()


def test_a_row_with_images_becomes_image_parts_where_its_placeholders_are() -> None:
    event = row_to_prompt(GEO3K, 4, uid_prefix="geo3k")
    (part_image, part_text) = event.prompt[0].content
    assert part_image.type == "image_url" and part_image.image_url.url.startswith("data:")
    assert part_text.text == "Find x. Put the answer in \\boxed{}."
    assert unused_columns(GEO3K) == []


def test_a_row_whose_images_do_not_match_its_placeholders_is_refused_with_its_number() -> None:
    with pytest.raises(RowError, match=r"row 5: images: 2 given, but the prompt has 1 <image>"):
        row_to_prompt({**GEO3K, "images": GEO3K["images"] * 2}, 4, uid_prefix="geo3k")
    with pytest.raises(RowError, match="videos"):
        row_to_prompt({**GSM8K, "videos": [{"video": "a.mp4"}]}, 0, uid_prefix="v")


def test_a_verl_parquet_reads_back_with_every_type(tmp_path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([SEARCH_R1]), path)
    ((number, row),) = list(read_rows(path))
    event = row_to_prompt(row, number, uid_prefix="p")
    assert event.reward_model.ground_truth == {"target": ["Shakespeare", "W. S."]}
    create = event.extra_info["tools_kwargs"]["search"]["create_kwargs"]
    assert create["question"] == "who wrote hamlet?"


def test_same_stem_datasets_get_different_uid_prefixes_and_one_file_keeps_its_own(
    tmp_path,
) -> None:
    a, b, copy = tmp_path / "gsm8k", tmp_path / "math", tmp_path / "copy"
    for d in (a, b, copy):
        d.mkdir()
    (a / "train.jsonl").write_text('{"prompt": "1+1?"}\n')
    (b / "train.jsonl").write_text('{"prompt": "2+2?"}\n')
    (copy / "train.jsonl").write_bytes((a / "train.jsonl").read_bytes())
    first, second = dataset_uid_prefix(a / "train.jsonl"), dataset_uid_prefix(b / "train.jsonl")
    assert first.startswith("train-") and second.startswith("train-") and first != second
    assert dataset_uid_prefix(copy / "train.jsonl") == first  # same bytes: same uids
