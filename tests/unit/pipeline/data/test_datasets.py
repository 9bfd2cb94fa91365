"""Dataset rows (verl format) become PromptEvents; bad rows are reported by number."""

from __future__ import annotations

import json

import pytest

from pipeline.data.arithmetic import arithmetic_rows, write_rows
from pipeline.data.datasets import DatasetError, RowError, read_rows, row_to_prompt


def test_arithmetic_rows_are_deterministic_and_valid() -> None:
    rows = arithmetic_rows(20, seed=7)
    assert rows == arithmetic_rows(20, seed=7)
    assert rows != arithmetic_rows(20, seed=8)
    for number, row in enumerate(rows):
        event = row_to_prompt(row, number, uid_prefix="x")
        question = event.extra_info["question"]
        a, op, b = question.removeprefix("What is ").rstrip("?").split()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert event.reward_model.ground_truth == str(expected)
        assert event.uid == row["uid"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_read_rows_from_files(tmp_path, suffix) -> None:
    rows = arithmetic_rows(5)
    path = write_rows(rows, tmp_path / f"d{suffix}")
    read = list(read_rows(path))
    assert [n for n, _ in read] == [0, 1, 2, 3, 4]
    events = [row_to_prompt(r, n, uid_prefix="d") for n, r in read]
    assert [e.uid for e in events] == [r["uid"] for r in rows]
    assert events[2].prompt[0].content == rows[2]["prompt"][0]["content"]


def test_row_errors_carry_row_numbers(tmp_path) -> None:
    path = tmp_path / "mixed.jsonl"
    good = {"prompt": "hello", "data_source": "openai/gsm8k"}
    path.write_text(
        "\n".join(
            [
                json.dumps(good),
                "{broken",
                json.dumps({"prompt": [], "data_source": "x"}),
                json.dumps({"prompt": "hi"}),
                json.dumps([1, 2]),
                json.dumps({**good, "n": 0}),
            ]
        )
        + "\n"
    )
    outcomes = []
    for number, row in read_rows(path):
        try:
            event = row_to_prompt(row, number, uid_prefix="mixed")
            outcomes.append((number, event.uid))
        except RowError as exc:
            outcomes.append((number, str(exc)))
    assert outcomes[0] == (0, "mixed-0")
    assert outcomes[1][1].startswith("row 2: not valid JSON")
    assert outcomes[2][1].startswith("row 3: prompt")
    assert outcomes[3][1].startswith("row 4: data_source")
    assert outcomes[4][1].startswith("row 5: expected an object")
    assert outcomes[5][1].startswith("row 6: n")


def test_string_prompt_and_default_data_source() -> None:
    event = row_to_prompt({"prompt": "2+2?"}, 9, uid_prefix="p", default_data_source="openai/gsm8k")
    assert event.prompt[0].role == "user" and event.uid == "p-9"
    assert event.data_source == "openai/gsm8k"


def test_unreadable_files(tmp_path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        list(read_rows(tmp_path / "none.jsonl"))
    other = tmp_path / "x.csv"
    other.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported"):
        list(read_rows(other))
    bad = tmp_path / "x.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="parquet"):
        list(read_rows(bad))


def test_a_wrong_path_or_format_fails_when_asked_not_when_read(tmp_path) -> None:
    """`rollout produce` calls read_rows before it connects, so the file's errors come first."""
    with pytest.raises(DatasetError, match="is a directory"):
        read_rows(tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "none.jsonl")
    bad = tmp_path / "x.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="parquet"):
        read_rows(bad)
    broken = tmp_path / "x.json"
    broken.write_text("[1,")
    with pytest.raises(DatasetError, match="not valid JSON"):
        read_rows(broken)


def test_a_verl_images_row_is_stored_and_an_oversize_one_refused_in_one_line(tmp_path) -> None:
    import io

    from PIL import Image

    from schemas.media import ImageRefPart
    from workers.media.config import MediaConfig
    from workers.media.ingest import Ingestor

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(out, format="PNG")
    row = {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": "<image>Find x."}],
        "images": [{"bytes": out.getvalue(), "path": None}],
    }
    store = tmp_path / "media"
    ingest = Ingestor(MediaConfig(store_dir=str(store)))
    event = row_to_prompt(row, 3, uid_prefix="g", ingest=ingest)
    (image, text) = event.prompt[0].content
    assert isinstance(image, ImageRefPart) and text.text == "Find x."
    assert (store / image.image_ref.sha256[:2] / image.image_ref.sha256).read_bytes() == (
        out.getvalue()
    )
    small = Ingestor(MediaConfig(store_dir=str(store), max_image_bytes=10))
    with pytest.raises(RowError) as refused:
        row_to_prompt(row, 3, uid_prefix="g", ingest=small)
    message = str(refused.value)
    assert message.startswith("row 4: prompt.0 image 0: ") and "\n" not in message
    assert "over media.max_image_bytes=10" in message
