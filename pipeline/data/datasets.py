"""Read verl-format datasets (parquet, JSONL) into `PromptEvent`s.

A row has verl's columns: `prompt` (chat messages, or a plain string taken as one user
message), `data_source`, `reward_model` (`{style, ground_truth}`, the ground truth of any JSON
type), `extra_info` (carried whole: `tools_kwargs`, `index`, …), optional `ability`,
`agent_name`, `n`, `uid` and `images`. Nothing in a row vanishes without a word: verl's
`images` column (a list of `{bytes, path}` dicts, paths or bytes, each standing where the
text says `<image>`) becomes image parts of the messages in placeholder order (a count that
does not match the placeholders is refused), a row with `videos` is refused with its row
number (not taken yet; training on the text alone would silently change the task), and any
other column the pipeline does not read is named, with how many rows had it, by
`unused_columns` (the producer's report counts them). Given an `ingest` (`rollout produce`
passes `workers.media.ingest.Ingestor`), the images are read, checked and stored, and the
event carries references; an image that fails is the row's error, in one line.

A row without `uid` gets a deterministic one,
`{prefix}-{row index}` (the index from 0; messages about a row count from 1, as editors do).
The prefix, unless given, is `dataset_uid_prefix(path)`: the file's
stem and a digest of its bytes (`train-3f2a9c1b`), so producing the same file again (from any
path) yields the same uids and downstream de-duplication recognises them, while two datasets
whose files share a stem (verl writes `gsm8k/train.parquet` and `math/train.parquet`) get
different ones. A file changed in any byte is a new dataset: pin `--uid-prefix` to keep the
old uids for rows that did not change.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.errors import RolloutError
from schemas.events import PromptEvent
from schemas.media import IMAGE_PLACEHOLDER
from workers.media.exceptions import MediaError

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
#: Media columns verl's datasets carry: geo3k's `images` (made image parts), `videos` (refused
#: rather than dropped).
MEDIA_COLUMNS = ("images", "videos")


class DatasetError(RolloutError):
    """The dataset file cannot be read at all."""


class RowError(RolloutError):
    """One row is not a valid prompt; carries its row number (from 0) and says it from 1, as
    an editor counts: `row 3` is the third row, the third line of a .jsonl file."""

    def __init__(self, row_number: int, message: str) -> None:
        super().__init__(f"row {row_number + 1}: {message}")
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
        if k not in READ_COLUMNS and k != "images" and not (k in MEDIA_COLUMNS and not v)
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


def _image_url(item: Any) -> str:
    """The `image_url` of one entry of verl's `images` column: bytes become a data: URI."""
    if isinstance(item, Mapping):
        item = item.get("bytes") or item.get("path") or item.get("image") or item.get("url")
    if isinstance(item, bytes | bytearray):
        return "data:application/octet-stream;base64," + base64.b64encode(item).decode()
    if isinstance(item, str) and item:
        return item
    raise ValueError("an image must be bytes, a path/URL, or a {bytes, path} object")


def _with_images(prompt: Any, images: list[Any]) -> list[Any]:
    """verl's `<image>` placeholders in `prompt`'s text replaced by `images`' parts, in order."""
    if not isinstance(prompt, list):
        raise ValueError("prompt must be a list of messages when the row has images")
    found = sum(
        m["content"].count(IMAGE_PLACEHOLDER)
        for m in prompt
        if isinstance(m, Mapping) and isinstance(m.get("content"), str)
    )
    if found != len(images):
        raise ValueError(
            f"{len(images)} given, but the prompt has {found} {IMAGE_PLACEHOLDER} "
            "placeholders (verl writes one where each image goes)"
        )
    urls = iter([_image_url(item) for item in images])
    messages = []
    for message in prompt:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            messages.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for index, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if index:
                parts.append({"type": "image_url", "image_url": {"url": next(urls)}})
            if text:
                parts.append({"type": "text", "text": text})
        messages.append({**message, "content": parts})
    return messages


def row_to_prompt(
    row: Any,
    row_number: int,
    *,
    uid_prefix: str,
    default_data_source: str | None = None,
    ingest: Callable[[PromptEvent], PromptEvent] | None = None,
) -> PromptEvent:
    """Validate one row into a `PromptEvent` (its images stored and referenced by `ingest`
    when given); `RowError` says what is wrong with it."""
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, Mapping):
        raise RowError(row_number, f"expected an object, got {type(row).__name__}")
    fields = dict(row)
    if fields.get("videos"):
        raise RowError(
            row_number,
            f"videos: {len(fields['videos'])} given, but prompts with videos are not "
            "supported yet (refused, not trained on the text alone)",
        )
    prompt = fields.get("prompt")
    if isinstance(prompt, str):
        fields["prompt"] = [{"role": "user", "content": prompt}]
    images = fields.get("images")
    if images is not None and len(images):
        try:
            fields["prompt"] = _with_images(fields.get("prompt"), list(images))
        except ValueError as exc:
            raise RowError(row_number, f"images: {exc}") from None
    extra_info = fields.get("extra_info") or {}
    uid = fields.get("uid") or (extra_info.get("uid") if isinstance(extra_info, Mapping) else None)
    fields["uid"] = str(uid) if uid is not None else f"{uid_prefix}-{row_number}"
    fields["extra_info"] = extra_info
    if not fields.get("data_source") and default_data_source:
        fields["data_source"] = default_data_source
    if fields.get("reward_model") is None:
        fields.pop("reward_model", None)
    try:
        event = PromptEvent.model_validate({k: v for k, v in fields.items() if k in READ_COLUMNS})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RowError(row_number, f"{where}: {first['msg']}") from exc
    if ingest is None:
        return event
    try:
        return ingest(event)
    except MediaError as exc:
        raise RowError(row_number, str(exc)) from None
