"""Read verl-format datasets (parquet, JSONL) into `PromptEvent`s.

A row has verl's columns: `prompt` (chat messages, or a plain string taken as one user
message), `data_source`, `reward_model` (`{style, ground_truth}`, the ground truth of any JSON
type), `extra_info` (carried whole: `tools_kwargs`, `index`, …), optional `ability`,
`agent_name`, `n` and `uid`. Nothing in a row vanishes without a word: a row with `images` or
`videos` is refused with its row number (they are not taken yet, and training on the text
alone would silently change the task), and any other column the pipeline does not read is
named, with how many rows had it, by `unused_columns` (the producer's report counts them).

A row without `uid` gets a deterministic one,
`{prefix}-{row_number}`. The prefix, unless given, is `dataset_uid_prefix(path)`: the file's
stem and a digest of its bytes (`train-3f2a9c1b`), so producing the same file again (from any
path) yields the same uids and downstream de-duplication recognises them, while two datasets
whose files share a stem (verl writes `gsm8k/train.parquet` and `math/train.parquet`) get
different ones. A file changed in any byte is a new dataset: pin `--uid-prefix` to keep the
old uids for rows that did not change.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.errors import RolloutError
from schemas.events import PromptEvent

__all__ = [
    "DatasetError",
    "RowError",
    "dataset_uid_prefix",
    "read_rows",
    "row_to_prompt",
    "unused_columns",
]

#: The columns a row may have that `row_to_prompt` reads.
READ_COLUMNS = frozenset(
    {"prompt", "data_source", "reward_model", "extra_info", "ability", "agent_name", "n", "uid"}
)
#: Media columns verl's datasets carry (geo3k's `images`), refused rather than dropped.
MEDIA_COLUMNS = ("images", "videos")


class DatasetError(RolloutError):
    """The dataset file cannot be read at all."""


class RowError(RolloutError):
    """One row is not a valid prompt; carries its row number."""

    def __init__(self, row_number: int, message: str) -> None:
        super().__init__(f"row {row_number}: {message}")
        self.row_number = row_number


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(row number from 0, row) for every row of a .parquet, .jsonl or .json file.

    The file is opened (and a .json or parquet file's structure checked) now, so a wrong
    path or format raises `DatasetError` before the caller connects to anything; the rows
    are read as the iterator is consumed. A JSONL line that is not JSON is yielded as a
    `RowError` value for the caller to count.
    """
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"dataset {path} is a directory, not a file")
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_rows(_open_parquet(path))
    if suffix in (".jsonl", ".ndjson"):
        return _jsonl_rows(path)
    if suffix == ".json":
        try:
            data = json.loads(path.read_bytes())
        except ValueError as exc:
            raise DatasetError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DatasetError(f"{path} must hold a JSON list of rows")
        return enumerate(data)
    raise DatasetError(f"unsupported dataset format {suffix!r} (use .parquet, .jsonl or .json)")


def dataset_uid_prefix(path: str | Path) -> str:
    """`{stem}-{8 hex digits of the file's BLAKE2b}`: stable for the same bytes, distinct
    for files that share a stem but not their content."""
    digest = hashlib.blake2b(digest_size=4)
    with Path(path).open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return f"{Path(path).stem}-{digest.hexdigest()}"


def unused_columns(row: Any) -> list[str]:
    """The columns of `row` that no stage reads (empty media columns count as absent)."""
    if not isinstance(row, Mapping):
        return []
    return sorted(
        str(k)
        for k, v in row.items()
        if k not in READ_COLUMNS and not (k in MEDIA_COLUMNS and not v)
    )


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as fh:
        for number, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as exc:
                yield number, RowError(number, f"not valid JSON: {exc}")


def _open_parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several unrelated types for bad files
        raise DatasetError(f"{path} is not a readable parquet file: {exc}") from exc


def _parquet_rows(handle: Any) -> Iterator[tuple[int, Any]]:
    number = 0
    for batch in handle.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield number, row
            number += 1


def row_to_prompt(
    row: Any, row_number: int, *, uid_prefix: str, default_data_source: str | None = None
) -> PromptEvent:
    """Validate one row into a `PromptEvent`; `RowError` says what is wrong with it."""
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, Mapping):
        raise RowError(row_number, f"expected an object, got {type(row).__name__}")
    fields = dict(row)
    for media in MEDIA_COLUMNS:
        if fields.get(media):
            raise RowError(
                row_number,
                f"{media}: {len(fields[media])} given, but prompts with {media} are not "
                "supported yet (refused, not trained on the text alone)",
            )
    prompt = fields.get("prompt")
    if isinstance(prompt, str):
        fields["prompt"] = [{"role": "user", "content": prompt}]
    extra_info = fields.get("extra_info") or {}
    uid = fields.get("uid") or (extra_info.get("uid") if isinstance(extra_info, Mapping) else None)
    fields["uid"] = str(uid) if uid is not None else f"{uid_prefix}-{row_number}"
    fields["extra_info"] = extra_info
    if not fields.get("data_source") and default_data_source:
        fields["data_source"] = default_data_source
    if fields.get("reward_model") is None:
        fields.pop("reward_model", None)
    try:
        return PromptEvent.model_validate({k: v for k, v in fields.items() if k in READ_COLUMNS})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RowError(row_number, f"{where}: {first['msg']}") from exc
